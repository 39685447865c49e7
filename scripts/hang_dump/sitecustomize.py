"""Dump every torchrun worker's Python stacks after N seconds, to find where a multi-GPU run hangs.

Put this folder on PYTHONPATH to find where a multi-GPU run hangs: every torchrun worker (RANK set) that
is still alive after MLITE_HANG_DUMP_S seconds (default 150) writes every thread's Python stack to
$MLITE_HANG_DUMP_DIR/hang-rank<RANK>-<pid>.txt (default /tmp) and keeps running. A stuck collective shows as
the frame that called it; a rank that left early shows no file. Training runs have their own, progress-
based watchdog (trainer.hang_timeout_s, mlite.trainers.watchdog); this is for every other process (the test
harness's workers, the bench). Used as:

    PYTHONPATH=scripts/hang_dump:$PYTHONPATH MLITE_HANG_DUMP_DIR=$OUT torchrun ...
"""

import faulthandler
import os

if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
    _folder = os.environ.get("MLITE_HANG_DUMP_DIR", "/tmp")
    _file = open(os.path.join(_folder, f"hang-rank{os.environ['RANK']}-{os.getpid()}.txt"), "w")  # noqa: SIM115
    faulthandler.dump_traceback_later(float(os.environ.get("MLITE_HANG_DUMP_S", "150")), file=_file)
