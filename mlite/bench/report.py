"""The report: one result per case and side (tokens/s, MFU, peak memory, the planner's estimate beside
it), the table `mlite bench` prints and the JSON file it writes, with the environment it ran in.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class BenchResult:
    case: str
    side: str  # mlite | hf | torchtitan (one GPU); mlite xN | N x one GPU (several)
    tokens_per_step: int  # tokens of one optimizer step, every micro-batch and data-parallel replica
    step_ms: float
    tokens_per_s: float
    flops_per_token: float  # the MFU formula's, for this case's sequence lengths
    mfu: float  # flops_per_token * tokens_per_s (per GPU) / the GPU's dense bf16 peak
    peak_gb: float
    estimate_gb: float | None = None
    device: str = ""
    extra: dict = field(default_factory=dict)
    skipped: str = ""  # why this side did not run (then no figure is measured), and what to compare with


def detect_gpu(device: str) -> tuple[str, float]:
    """(gpu type as the config names it, dense bf16 peak TFLOP/s) of the device."""
    from mlite.config.schema import GPU_BF16_TFLOPS

    if not device.startswith("cuda"):
        return "cpu", GPU_BF16_TFLOPS["cpu"]
    import torch

    name = torch.cuda.get_device_name().lower()
    gpu = next((g for g in GPU_BF16_TFLOPS if g != "cpu" and g in name.replace(" ", "")), "h100")
    return gpu, GPU_BF16_TFLOPS[gpu]


def environment(device: str) -> dict:
    import datetime
    import platform

    import torch

    import mlite

    env = {"date": datetime.date.today().isoformat(), "mlite": mlite.__version__, "torch": torch.__version__,
           "python": platform.python_version(), "device": device}
    if device.startswith("cuda"):
        env |= {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:  # read from its metadata: importing torchtitan takes seconds, and only its side needs it
        env["torchtitan"] = version("torchtitan")
    except PackageNotFoundError:
        pass
    return env


def write_results(results: list[BenchResult], out: Path, meta: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2))


def render_table(results: list[BenchResult]):
    from rich.table import Table

    table = Table(title="mlite bench (median step after warm-up)")
    for col in ("case", "side", "tokens/s", "MFU", "step ms", "peak GB", "plan GB", "plan err", "scaling"):
        table.add_column(col, justify="right" if col not in ("case", "side") else "left")
    notes = []
    for r in results:
        if r.skipped:
            table.add_row(r.case, r.side, "skipped", "", "", "", "", "", "")
            notes.append(f"{r.case} {r.side}: {r.skipped}")
            continue
        if "torchtitan" in r.extra and f"torchtitan {r.extra['torchtitan']}" not in notes:
            notes.append(f"torchtitan {r.extra['torchtitan']}")
        err = "" if not r.estimate_gb or not r.peak_gb else f"{(r.estimate_gb - r.peak_gb) / r.peak_gb:+.0%}"
        table.add_row(
            r.case, r.side, f"{r.tokens_per_s:,.0f}", f"{r.mfu:.1%}", f"{r.step_ms:.1f}", f"{r.peak_gb:.1f}",
            "" if r.estimate_gb is None else f"{r.estimate_gb:.1f}", err,
            f"{r.extra['scaling']:.0%}" if "scaling" in r.extra else "",
        )
    if notes:
        table.caption = "\n".join(notes)
    return table
