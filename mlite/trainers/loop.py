"""The one training loop SFT and GRPO share. It owns everything around a step:

- the output folder, the checkpoint manager, resume (`trainer.resume`: auto, never or a path) and the
  trainer's extra state in each checkpoint;
- the step count (`trainer.steps`, capped by `trainer.epochs` x the trainer's steps per epoch) and the LR
  schedule's length;
- metrics (JSONL, TensorBoard), progress (tokens/s, ETA), the evaluation cadence (`trainer.eval_every` and
  at the end), the save cadence (`trainer.save_every` and at the end);
- when a step's numbers are read: an SFT step leaves its loss and grad norm as tensors on the device, and
  the loop reads them once the next step is queued (at once before an evaluation or a save), so on a GPU
  the host never keeps the device waiting between steps;
- the stop signal (SIGTERM/SIGUSR1 save at the next step boundary and return: Slurm preemption and
  requeue), the PNG plot, `runtime.close()` and the summary, printed by the output rank only;
- the hang watchdog (`trainer.hang_timeout_s`, `trainer.startup_timeout_s` until the first step is done;
  mlite.trainers.watchdog): a phase that makes no progress for that long ends the process with every
  thread's stack on disk.

A trainer supplies only what differs: `step(index)` (one optimizer step and its metrics), `evaluate()`,
its extra checkpoint state and its summary lines (the `Trainer` protocol below).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.runtime.ckpt.checkpoint import CheckpointManager
from mlite.runtime.engine import Runtime
from mlite.runtime.parallel.step import host_number
from mlite.trainers.common import StopRequest, checkpoint_to_resume, first_rank
from mlite.trainers.metrics import (
    MetricsWriter,
    ProgressDisplay,
    format_value,
    plot_metrics,
    read_metrics,
)
from mlite.trainers.watchdog import Watchdog

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What a step logs. Its numbers may be 0-dim tensors still being computed on the GPU: the loop reads
    them (`host_values`) only after the next step's work is queued, so the GPU never waits for the host
    between steps; the values logged are the same."""

    metrics: dict[str, Any]  # what the step logs (numbers or 0-dim tensors)
    tokens: float  # tokens the step trained on, over all ranks (for tokens/s)
    progress: tuple[str, Any]  # the figure the progress line shows, e.g. ("loss", 0.41)
    note: str = ""  # appended to the progress line
    skipped: Any = False  # the optimizer dropped this step's update (non-finite gradients)


def host_values(values: dict[str, Any]) -> dict[str, Any]:
    return {key: host_number(value) for key, value in values.items()}


class StepClock:
    """A step's time, whenever its numbers are read (one step late, or at once before a save). On a GPU:
    the device's span from where the host began queueing the step to where it had queued all of it (two
    CUDA events on the compute stream; reading the step's numbers has waited for its work). Elsewhere the
    work is done when `trainer.step` returns: the host's time for it. Timing from the read instead gave a
    step read right after the one ahead of it almost no time (a save step on the CPU: millions of tokens/s,
    and a run's mean speed with it)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        began = torch.cuda.Event(enable_timing=True)
        began.record()
        return began

    def stop(self, began: Any) -> tuple:
        if not self.cuda:
            return began, time.perf_counter()
        ended = torch.cuda.Event(enable_timing=True)
        ended.record()
        return began, ended

    def seconds(self, span: tuple) -> float:
        began, ended = span
        if not self.cuda:
            return ended - began
        ended.synchronize()
        return began.elapsed_time(ended) / 1e3


def _unread(result: StepResult) -> bool:
    """The step left numbers as tensors (the SFT step; GRPO's, which waits on its rollout, reads its own)."""
    values = [*result.metrics.values(), result.progress[1], result.skipped]
    return any(isinstance(value, torch.Tensor) for value in values)


class Trainer(Protocol):
    name: str  # "sft", "grpo": the progress label
    plot_keys: tuple[str, ...]
    plot_file: str
    eval_at_start: bool  # evaluate before the first step (a baseline for the end's figure)

    def steps_per_epoch(self) -> int: ...
    def step(self, index: int) -> StepResult: ...  # index: 0-based number of the step to run
    def evaluate(self) -> dict[str, float]: ...  # {} when there is nothing to evaluate
    def state_dict(self) -> dict[str, Any]: ...  # JSON-able, saved with each checkpoint
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def summary_lines(self, result: RunResult) -> list[str]: ...


@dataclass
class RunResult:
    output_dir: Path
    start_step: int  # 0, or the step resumed from
    last_step: int  # the last finished optimizer step
    total_steps: int
    checkpoint: Path | None  # the checkpoint written last (None if none was written)
    metrics_path: Path
    plot_path: Path | None
    stopped_by: str | None = None  # the signal that ended the run early
    tokens_per_s: float | None = None  # mean of the logged steps' tokens/s over the whole run (resumes too)
    is_output_rank: bool = True  # the rank that wrote metrics and prints the summary
    evals: list[dict[str, Any]] = field(default_factory=list)  # {"step": s, **evaluate()} of this process
    summary: list[str] = field(default_factory=list)  # what `print_summary` prints (rich markup)


def total_steps(job: JobConfig, steps_per_epoch: int) -> int:
    """trainer.steps, or fewer when trainer.epochs passes first."""
    if job.trainer.epochs is None:
        return job.trainer.steps
    return min(job.trainer.steps, job.trainer.epochs * steps_per_epoch)


def run(job: JobConfig, runtime: Runtime, trainer: Trainer, console=None,
        show_progress: bool = True, watch: Watchdog | None = None) -> RunResult:
    """Train (or continue training) `trainer` on `runtime`; returns where everything went. The runtime's
    process group is closed on the way out, whatever happens. `watch`: the caller's running watchdog (it
    watched the start-up too); without one the loop runs its own."""
    try:
        with contextlib.nullcontext(watch) if watch is not None else Watchdog.for_job(job) as watch:
            result = _run(job, runtime, trainer, console, show_progress, watch)
    except BaseException:
        runtime.close(clean=False)
        raise
    runtime.close()
    return result


# one loop whose two closures (evaluate, publish) share its state: the step read one step late, the skip
# streak, the last checkpoint; split further, each part would take all of it as arguments
def _run(job, runtime, trainer, console, show_progress, watch: Watchdog) -> RunResult:
    cfg = job.trainer
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    total = total_steps(job, trainer.steps_per_epoch())
    runtime.set_total_steps(total)
    manager = CheckpointManager(out, cfg.keep_last)
    manager.clean_partials()  # this run holds the folder's lock: leftovers of a failed save are its own

    start, resume_from = _resume(cfg.resume, runtime, trainer, manager, watch)
    output = first_rank()
    if output and console is not None:  # what `mlite plan` notes of this job (e.g. FP8 that gains nowhere)
        for note in runtime.plan.memory.notes:
            console.print(f"note: {note}", highlight=False)
    writer = MetricsWriter(out, cfg.tensorboard, resume_step=start, enabled=output)
    progress = ProgressDisplay(total, start, trainer.name, enabled=show_progress and output, console=console)
    last_saved: Path | None = resume_from  # a finished run rerun with resume=auto writes nothing new
    step, stopped_by, evals = start, None, []
    skipped_in_a_row: list[int] = []  # the steps since the last update that was not skipped

    def evaluate(at: int) -> dict[str, float]:
        watch.beat(f"the evaluation at step {at}")
        values = trainer.evaluate()
        if values:
            evals.append({"step": at, **values})
        return values

    if trainer.eval_at_start and start == 0 and (values := evaluate(0)):
        writer.log(0, values)
    clock = StepClock(runtime.device)

    def publish(at: int, result: StepResult, span: tuple, evaluated: dict) -> None:
        """Read step `at`'s numbers (waiting for its device work) and log them with its time (`clock`)."""
        watch.beat(f"reading step {at}'s figures (waiting for its device work)")
        metrics = host_values(result.metrics)
        label, value = result.progress[0], host_number(result.progress[1])
        skipped = bool(host_number(result.skipped))
        elapsed = clock.seconds(span)
        record = {**metrics, "tokens_per_s": result.tokens / elapsed, "step_time_s": elapsed, **evaluated}
        if at % cfg.log_every == 0 or at == total or evaluated or skipped:
            writer.log(at, record)
            note = " ".join(filter(None, [result.note, "(skipped: non-finite grads)" if skipped else ""]))
            progress.update(at, value, result.tokens / elapsed, note, label=label)
        skipped_in_a_row[:] = [*skipped_in_a_row, at] if skipped else []
        if len(skipped_in_a_row) >= cfg.max_skipped_steps:
            raise MliteError(
                f"{len(skipped_in_a_row)} steps in a row ({skipped_in_a_row[0]}-{at}) had non-finite "
                f"gradients (loss {format_value(value)}) and were skipped, so training stopped "
                f"(trainer.max_skipped_steps={cfg.max_skipped_steps}); the last checkpoint is {last_saved}; "
                "lower optimizer.lr or check the data, then rerun to resume from it")

    runtime.train()
    pending = None  # (step, result, span) of a step whose numbers are not read yet
    with StopRequest() as stop:
        while step < total:
            began = clock.start()
            watch.beat(f"step {step + 1}")
            result = trainer.step(step)
            span = clock.stop(began)
            step += 1
            if pending is not None:  # this step is queued: now the one before it is read
                publish(*pending, {})
                pending = None
            evaluated = {}
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == total:
                evaluated = evaluate(step)
            stopped = stop.should_stop()
            save = stopped or step == total or (cfg.save_every and step % cfg.save_every == 0)
            if evaluated or save or not _unread(result):
                publish(step, result, span, evaluated)
            else:  # read it once the next step is queued
                pending = (step, result, span)
            if save:
                watch.beat(f"saving the checkpoint of step {step}")
                last_saved = _save(step, runtime, trainer, manager, last_saved)
            if stopped:
                stopped_by = stop.received
                break
            if not watch.settled:  # the first step has compiled: every phase now gets hang_timeout_s
                watch.settle()
        if pending is not None:
            publish(*pending, {})
    progress.close()
    writer.close()
    result = RunResult(out, start, step, total, last_saved, writer.path, None, stopped_by, None, output,
                       evals)
    return _finish(result, trainer)


def _resume(resume: str, runtime, trainer, manager: CheckpointManager,
            watch: Watchdog) -> tuple[int, Path | None]:
    """trainer.resume applied: (the step the run continues after, the checkpoint it loaded or None)."""
    path = checkpoint_to_resume(resume, manager)
    if path is None:
        return 0, None
    watch.beat(f"resuming from {path}")
    extra = runtime.load_checkpoint(path)
    start = int(extra.pop("step"))
    trainer.load_state_dict(extra)
    log.info("resumed from %s at step %d", path, start)
    return start, path


def _save(step: int, runtime, trainer, manager: CheckpointManager, last_saved: Path | None) -> Path:
    """The checkpoint of `step`, written only from finite weights (every rank checks its own)."""
    if not runtime.weights_finite():
        raise MliteError(f"the weights hold NaN or inf after step {step}, so no checkpoint was written (the "
                         f"last one is {last_saved}); lower optimizer.lr or check the data, then rerun to "
                         "resume from it")
    extra = {"step": step, **trainer.state_dict()}
    return manager.save(step, lambda path: runtime.save_checkpoint(path, extra))


def _finish(result: RunResult, trainer) -> RunResult:
    """The plot (a run that ended, not one stopped by a signal), the run's mean speed and its summary, on
    the output rank."""
    if not result.is_output_rank:
        return result
    if result.stopped_by is None:
        result.plot_path = plot_metrics(result.metrics_path, result.output_dir / trainer.plot_file,
                                        trainer.plot_keys, f"{trainer.name} ({result.output_dir.name})")
    speeds = [r["tokens_per_s"] for r in read_metrics(result.metrics_path) if "tokens_per_s" in r]
    result.tokens_per_s = sum(speeds) / len(speeds) if speeds else None
    result.summary = summary_lines(result, trainer.summary_lines(result))
    return result


def summary_lines(result: RunResult, lines: list[str]) -> list[str]:
    """The trainer's lines between the run's common ones: how it stopped, speed, where the files are."""
    head, tail = [], []
    if result.stopped_by:
        head.append(f"[yellow]stopped by {result.stopped_by} after step "
                    f"{result.last_step}/{result.total_steps}; "
                    "checkpoint saved, rerun the same command (trainer.resume=auto) to continue[/yellow]")
    if result.tokens_per_s is not None and math.isfinite(result.tokens_per_s):
        # over the run's logged steps, from the metrics file: a run resumed at its last step still has them
        tail.append(f"speed       {result.tokens_per_s:,.0f} tokens/s")
    tail += [f"checkpoint  {result.checkpoint}", f"metrics     {result.metrics_path}"]
    if result.plot_path:
        tail.append(f"plot        {result.plot_path}")
    return head + lines + tail


def print_summary(result: RunResult, console) -> None:
    """The run's summary, on the output rank only (other ranks' results have none)."""
    for line in result.summary:
        console.print(line, highlight=False)
