"""A rank that stops making progress ends the job, with every thread's stack on disk.

A multi-rank job hangs when one rank waits in a collective for a peer that never arrives: a peer stuck in
user code (a reward server that does not answer), one that raised where the others went on (the dist_opt
checkpoint of issue 17), or a network fault. NCCL's own timeout may be long or off, and a hung job burns
its whole allocation before anyone sees that nothing moved. The training loop calls `beat(what)` at each
phase of a step; a thread checks the time since the last beat. Past `trainer.hang_timeout_s` it writes
every thread's Python stack to `<output_dir>/hang/rank<R>.txt`, prints one line naming the rank, the phase
and the file, and ends the process with status 124 (as `timeout` does), so the launcher (torchrun, srun)
ends the others. The stuck rank's stack shows where it waits; a rank waiting in a collective shows the
collective, and the rank whose file does not show one is the one the others wait for.

    with Watchdog(timeout_s, out_dir, "sft") as watch:
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
    """Ends this process when `timeout_s` pass without a `beat`; None: off."""

    def __init__(self, timeout_s: float | None, out_dir: str | Path, command: str):
        self.timeout_s = timeout_s
        self.folder = Path(out_dir) / "hang"
        self.command = command
        self.what = "start"
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, what: str) -> None:
        """Progress: `what` the loop starts now (named in the message if it never finishes)."""
        self.what, self.last = what, time.monotonic()

    def __enter__(self) -> Watchdog:
        if self.timeout_s is not None:
            self.last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="mlite-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        period = min(5.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            waited = time.monotonic() - self.last
            if waited > self.timeout_s:
                self._end(waited)

    def _end(self, waited: float) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{rank():05d}.txt"
        with open(path, "w") as stacks:
            stacks.write(f"rank {rank()}: no progress for {waited:.0f} s in: {self.what}\n")
            stacks.flush()
            faulthandler.dump_traceback(file=stacks, all_threads=True)
        print(f"mlite {self.command}: error: rank {rank()} made no progress for {waited:.0f} s "
              f"(trainer.hang_timeout_s={self.timeout_s:g}) in: {self.what}; every thread's stack is in "
              f"{path} (a rank waiting in a collective waits for one whose stack shows where it is stuck); "
              "raise trainer.hang_timeout_s if this phase is only slow", file=sys.stderr, flush=True)
        os._exit(EXIT_HANG)  # the main thread is stuck: no clean shutdown can run
