"""`mlite bench`: the trainers' training step next to the HF-transformers baseline (and torchtitan's, with
`--titan`), in one launch.

The mlite side is `mlite.runtime.engine.Runtime` driven as the SFT trainer drives it, with no step of the
benchmark's own; the HF side is transformers' own model on the same tokens. We report tokens/s, MFU, peak
memory, and the planner's memory estimate next to the measured peak (median step after warm-up).

- `cases`: the CASES table, what a case is as a model, a job, a planner estimate and token batches.
- `flops`: the FLOPs per token and MFU of a case's packed sequences.
- `measure`: either side's step timed, its peak memory read; the launch's collective bandwidth.
- `mlite_side`: the Runtime's step for a case, and the torchrun launch it runs in.
- `hf_side`: the HF transformers baseline.
- `titan_side`: torchtitan's own Qwen3 step (bf16 or its float8), the peer of `--titan`.
- `run`: a case's sides measured into results (one GPU; several GPUs against N x one GPU).
- `report`: the results, the table `mlite bench` prints, the JSON file it writes.

Below: the names the GPU scripts take as `bench.<name>` (scripts/ab_step.py, profile_step.py, ...).
"""

from __future__ import annotations

from mlite.bench.cases import CASES, case_arch, mixed_lengths
from mlite.bench.measure import free_memory, time_steps
from mlite.bench.mlite_side import case_step, hold_launch_group

__all__ = [
    "CASES",
    "case_arch",
    "case_step",
    "free_memory",
    "hold_launch_group",
    "mixed_lengths",
    "time_steps",
]
