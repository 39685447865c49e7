"""A rank that stops making progress ends the job, with every thread's stack on disk.

A multi-rank job hangs when one rank waits in a collective for a peer that never arrives: a peer stuck in
user code (a reward server that does not answer), one that raised where the others went on (a checkpoint
save that fails on one rank while its peers wait in the save's all-reduce), or a network fault. NCCL's own
timeout may be long or off, and a hung job burns its whole allocation before anyone sees that nothing
moved. The training loop calls `beat(what)` at each phase of a step; a thread checks the time since the last
beat. Past its limit (`trainer.startup_timeout_s`
for the start-up and the first step, which compiles; `trainer.hang_timeout_s` after it) it writes
every thread's Python stack to `<output_dir>/hang/rank<R>.txt`, prints one line naming the rank, the phase
and the file, and ends the process with status 124 (as `timeout` does), so the launcher (torchrun, srun)
ends the others. The stuck rank's stack shows where it waits; a rank waiting in a collective shows the
collective, and the rank whose file does not show one is the one the others wait for.

A rank can also leave without a Python error: killed by a signal in native code (a segfault in a kernel, a
collective or an extension). The launcher then reports only the signal, so the watchdog also turns on
`faulthandler` for the job, which prints every thread's Python stack to stderr on such a crash.

    with Watchdog.for_job(job) as watch:       # train_sft / train_grpo: start-up, then the loop
        watch.beat("step 3")
        ...
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

EXIT_HANG = 124


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class Watchdog:
    """Ends this process when a phase outlasts its limit: `startup_s` until `settle()` (start-up and the first
    step, which compiles), `timeout_s` after it; None: that part is not watched."""

    def __init__(self, timeout_s: float | None, out_dir: str | Path, command: str,
                 startup_s: float | None = None):
        self.timeout_s, self.startup_s = timeout_s, startup_s
        self.settled = False
        self.folder = Path(out_dir) / "hang"
        self.command = command
        self.what = "start"
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_job(cls, job) -> Watchdog:
        """The watchdog of a training job: trainer.startup_timeout_s until the first step is done,
        trainer.hang_timeout_s after it; its output folder; its command."""
        cfg = job.trainer
        return cls(cfg.hang_timeout_s, cfg.output_dir, job.job, cfg.startup_timeout_s)

    def beat(self, what: str) -> None:
        """Progress: `what` the loop starts now (named in the message if it never finishes)."""
        self.what, self.last = what, time.monotonic()

    def settle(self) -> None:
        """The first step is done: from now on each phase gets `timeout_s`."""
        self.settled = True
        self.last = time.monotonic()

    @property
    def limit(self) -> float | None:
        return self.timeout_s if self.settled else self.startup_s

    def __enter__(self) -> Watchdog:
        faulthandler.enable(all_threads=True)  # idempotent; PYTHONFAULTHANDLER=1 turns it on the same way
        if self.timeout_s is not None or self.startup_s is not None:
            self.last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="mlite-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        period = min(5.0, *(s / 4 for s in (self.timeout_s, self.startup_s) if s is not None))
        while not self._stop.wait(period):
            waited, limit = time.monotonic() - self.last, self.limit
            if limit is not None and waited > limit:
                self._end(waited, limit)

    def _end(self, waited: float, limit: float) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{rank():05d}.txt"
        with open(path, "w") as stacks:
            stacks.write(f"rank {rank()}: no progress for {waited:.0f} s in: {self.what}\n")
            stacks.flush()
            faulthandler.dump_traceback(file=stacks, all_threads=True)
        key = "trainer.hang_timeout_s" if self.settled else "trainer.startup_timeout_s"
        print(f"mlite {self.command}: error: rank {rank()} made no progress for {waited:.0f} s "
              f"({key}={limit:g}) in: {self.what}; every thread's stack is in {path} (a rank waiting in a "
              f"collective waits for one whose stack shows where it is stuck); raise {key} if this phase is "
              "only slow", file=sys.stderr, flush=True)
        os._exit(EXIT_HANG)  # the main thread is stuck: no clean shutdown can run
