"""Python's garbage collector on the training step's schedule (`trainer.gc_every`).

Left to itself the collector runs whenever allocations cross its thresholds: at another moment on each
rank, and a full pass over a training process's objects (modules, compiled graphs, autograd's) takes tens
of milliseconds. Ranks that meet at collectives in every layer then all wait for the one that collects, and
a one-GPU run loses a step's worth of time now and then. With `gc_every` N the automatic collector is off
while a Runtime lives; every rank collects the young generations after every Nth optimizer step and
everything after every tenth of those, at the same point of the same step on every rank (torchtitan
collects on such a schedule too). 0 leaves Python's own schedule.
"""

from __future__ import annotations

import gc

FULL_EVERY = 10  # of the scheduled collections, every tenth is a full one: garbage that reached the
# oldest generation (cycles that outlived a young collection) is freed too, at a known step


class StepCollection:
    """The collector's schedule for one Runtime: `step()` after each optimizer step, `close()` at the end.
    Several live at once (GRPO's policy beside a reference copy, an A/B's variants): the automatic
    collector stays off until the last one closes."""

    live = 0  # StepCollections that turned the automatic collector off and are not closed
    enabled_before = True  # the automatic collector's state when the first of them turned it off

    def __init__(self, every: int):
        self.every = every
        self.steps = 0
        self.holds = every > 0
        if self.holds:
            if StepCollection.live == 0:
                StepCollection.enabled_before = gc.isenabled()
                gc.disable()
            StepCollection.live += 1

    def step(self) -> None:
        if not self.holds:
            return
        self.steps += 1
        if self.steps % self.every == 0:
            gc.collect(2 if self.steps % (self.every * FULL_EVERY) == 0 else 1)

    def close(self) -> None:
        if not self.holds:
            return
        self.holds = False
        StepCollection.live -= 1
        if StepCollection.live == 0 and StepCollection.enabled_before:
            gc.enable()
