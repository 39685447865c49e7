"""The progress line a run prints on a Slurm log or CI (no terminal): step, figure, tokens/s, ETA."""

from __future__ import annotations

import io
import math

from rich.console import Console

from mlite.trainers.metrics import ProgressDisplay, format_value


def test_figures_near_zero_keep_their_digits_and_lose_the_negative_zero():
    assert format_value(0.29321) == "0.2932" and format_value(5.11764) == "5.1176"
    assert format_value(-0.0) == format_value(0.0) == "0.0000"
    assert format_value(-3.2e-6) == "-3.20e-06" and format_value(4.1e-4) == "4.10e-04"
    assert format_value(-0.0041) == "-0.0041"
    assert format_value(math.nan) == "nan"


def test_the_plain_progress_line_has_the_figure_speed_and_eta():
    out = io.StringIO()
    progress = ProgressDisplay(80, description="grpo", console=Console(file=out, width=200))
    progress.update(5, -2.5e-6, 1234.4, "reward 0.562", label="pg_loss")
    line = out.getvalue().strip()
    assert line.startswith("grpo step 5/80  pg_loss -2.50e-06  1,234 tok/s  ETA 0:")
    assert line.endswith("reward 0.562")


def test_a_log_gets_each_line_whole(capsys):
    """Under Slurm or CI stderr is a file: rich would wrap at 80 columns (a data report split mid-number)."""
    from mlite.trainers.metrics import stream_console

    line = "train: 4000 rows in 1 files; 4000 used (167240 tokens, 74193 trained, longest 55); " * 3
    stream_console().print(line.strip(), highlight=False)
    assert capsys.readouterr().err == line.strip() + "\n"
