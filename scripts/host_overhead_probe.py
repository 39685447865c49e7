"""How much of a bench case's step is host overhead: time the trainers' Runtime step (as `mlite bench`)
with torch.compile's default wrapper, with its C++ wrapper (less Python per compiled-graph call), or with
CUDA graphs (one replay per block: no per-kernel launches). One mode per process (the modes change
torch.compile's configuration).

    python3 scripts/host_overhead_probe.py dense-1.7b-4k {default|cpp_wrapper|cudagraphs}
"""

from __future__ import annotations

import sys
import time

import torch
import torch._inductor.config as inductor

from mlite import bench

case_name, mode = sys.argv[1], sys.argv[2]
if mode == "cpp_wrapper":
    inductor.cpp_wrapper = True
elif mode == "cudagraphs":
    inductor.triton.cudagraphs = True
elif mode != "default":
    raise SystemExit(f"unknown mode {mode}")
step, _runtime, last = bench.case_step(case_name)
for _ in range(4):
    step()
torch.cuda.synchronize()
times = []
for _ in range(8):
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    times.append((time.perf_counter() - start) * 1e3)
times.sort()
print(f"{case_name} {mode}: median {times[len(times) // 2]:.1f} ms "
      f"(min {times[0]:.1f}, max {times[-1]:.1f}); loss {last['loss']:.4f}; "
      f"peak {torch.cuda.max_memory_reserved() / 1e9:.1f} GB")
