"""Training metrics: a JSONL file (the record a resumed run continues exactly), TensorBoard scalars, a PNG
loss curve, and a progress display with loss, tokens/s and ETA. Shared by the SFT and GRPO trainers.

Only the output rank writes (rank 0); other ranks get a writer that does nothing.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlite.errors import MliteError

METRICS_FILE = "metrics.jsonl"
# records a resumed run moved out of METRICS_FILE (logged after its checkpoint by the run it continues,
# or the torn last line of a run that died mid-write): kept, never deleted
SUPERSEDED_FILE = "metrics.superseded.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "loss.png"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics file, without their null figures (a non-finite number was logged as null).
    A last line that is not whole JSON (the process died mid-write) is left out; a torn line anywhere else
    is refused in one line."""
    records, _ = _read_records(Path(path))
    return [{k: v for k, v in record.items() if v is not None} for record in records]


def _read_records(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """(whole records, the torn last line or None)."""
    if not path.is_file():
        return [], None
    try:
        lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
                 if line.strip()]
    except OSError as err:
        raise MliteError(f"cannot read {path} ({err.strerror}); check the file") from None
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        elif number == len(lines):
            return records, line
        else:
            raise MliteError(f"{path} line {number} is not a metrics record; move the file aside to "
                             "start a new one, or repair that line")
    return records, None


def json_record(record: dict[str, Any]) -> str:
    """One JSON line; a non-finite number (a NaN loss) is null, as JSON has no NaN."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    return json.dumps(clean, allow_nan=False)


class MetricsWriter:
    """Appends one JSON record per logged step to `{output_dir}/metrics.jsonl` and the same scalars to
    TensorBoard. A run resumed from step k (0: started afresh) first moves the records after k (written by
    the interrupted run past its last checkpoint) to `metrics.superseded.jsonl`, so the file reads as if
    the run had never stopped and nothing logged is lost."""

    def __init__(self, output_dir: str | Path, tensorboard: bool = True, resume_step: int = 0,
                 enabled: bool = True):
        self.enabled = enabled
        self.path = Path(output_dir) / METRICS_FILE
        self.tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records, torn = _read_records(self.path)
        kept = [r for r in records if r["step"] <= resume_step]
        moved = [json_record(r) for r in records if r["step"] > resume_step] + ([torn] if torn else [])
        if moved:  # first the superseded copy, then the cut file: a crash in between loses nothing
            with open(self.path.with_name(SUPERSEDED_FILE), "a") as f:
                f.write("".join(line + "\n" for line in moved))
                f.flush()
                os.fsync(f.fileno())
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json_record(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        self.file = open(self.path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides the events the interrupted run wrote after the checkpoint
            self.tb = SummaryWriter(str(Path(output_dir) / TENSORBOARD_DIR),
                                    purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json_record({"step": step, **values}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def plot_metrics(
    metrics_path: str | Path, png_path: str | Path, keys: Iterable[str] = ("loss",),
    title: str = "training loss",
) -> Path | None:
    """A PNG of `keys` against the step (matplotlib, no display needed). None when nothing was logged."""
    records = read_metrics(metrics_path)
    keys = [k for k in keys if any(k in r for r in records)]
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 3.2 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        points = [(r["step"], r[key]) for r in records if key in r]
        ax.plot(*zip(*points), marker="." if len(points) < 60 else None)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[0, 0].set_title(title)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def stream_console():
    """The console runs print to (stderr). In a log (a Slurm output file, CI: no terminal) a line stays one
    line: rich would wrap it at 80 columns, mid-number."""
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        console.soft_wrap = True
    return console


def format_value(value: float) -> str:
    """A logged figure in the progress line: four decimals, or two significant digits in scientific notation
    below 0.001 (GRPO's policy loss sits near 0, where "-0.0000" told nothing); no negative zero."""
    value += 0.0  # -0.0 -> 0.0
    return f"{value:.2e}" if 0 < abs(value) < 1e-3 else f"{value:.4f}"


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ProgressDisplay:
    """A live progress bar on a terminal (loss, tokens/s, ETA); one plain line per logged step otherwise
    (Slurm logs, CI). ETA extrapolates the mean step time of this process (a resumed run restarts it)."""

    def __init__(self, total_steps: int, start_step: int = 0, description: str = "train",
                 enabled: bool = True, console=None):
        self.enabled = enabled
        self.total, self.start = total_steps, start_step
        self.console = console or stream_console()
        self.started = time.perf_counter()
        self.live = enabled and self.console.is_terminal
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), console=self.console, transient=False,
            )
            self.task = self.progress.add_task(description, total=total_steps, completed=start_step,
                                               status="")
            self.progress.start()
        self.description = description

    def eta(self, step: int) -> float:
        done = step - self.start
        return (time.perf_counter() - self.started) / done * (self.total - step) if done > 0 else float("nan")

    def update(self, step: int, loss: float, tokens_per_s: float, extra: str = "",
               label: str = "loss") -> None:
        if not self.enabled:
            return
        eta = self.eta(step)
        status = (f"{label} {format_value(loss)}  {tokens_per_s:,.0f} tok/s  "
                  f"ETA {format_duration(eta) if math.isfinite(eta) else '?'}")
        status += f"  {extra}" if extra else ""
        if self.live:
            self.progress.update(self.task, completed=step, status=status)
        else:
            self.console.print(f"{self.description} step {step}/{self.total}  {status}", highlight=False)

    def close(self) -> None:
        if self.live:
            self.progress.stop()
