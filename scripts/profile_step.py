"""Profile one mlite training step of a bench case on a GPU (the trainers' Runtime step, as `mlite bench`
times it, with model.compile): the top CUDA kernels by self time.

    python3 scripts/profile_step.py dense-1.7b-4k
"""

from __future__ import annotations

import argparse

import torch

from mlite import bench

parser = argparse.ArgumentParser()
parser.add_argument("case")
parser.add_argument("--rows", type=int, default=25)
args = parser.parse_args()

case = bench.CASES[args.case]
arch = bench.case_arch(case)
seqs = bench.random_sequences(bench.case_seq_lens(case), arch.vocab, seed=0)
step, _runtime, _last = bench.runtime_step_fn(case, seqs, "cuda")
for _ in range(3):
    step()
torch.cuda.synchronize()
with torch.profiler.profile(
    activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
) as prof:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
print(f"== {args.case} (Runtime step, model.compile)")
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows,
                                max_name_column_width=70))
