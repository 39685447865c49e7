"""How far the host runs ahead of its GPU through a bench step (CUDA only), on every rank of the launch.
A mark (a CUDA event and the host clock) at each block's forward and at each Runtime call of the step; its
lead is when the GPU reached the mark minus when the host queued it. A lead near 0 is the GPU waiting for
the host there: a host-bound step. Rank 0 prints the last of 3 steps mark by mark; every other rank its
range of forward leads (with several ranks, collectives pace every GPU by the slowest host).

    torchrun --standalone --nproc-per-node 2 scripts/host_lead.py dense-1.7b-4k-dp2
    python3 scripts/host_lead.py dense-1.7b-4k
"""
import os
import sys
import time

import torch
import torch.distributed as dist

from mlite import bench
from mlite.runtime.parallel.parallelize import blocks

case = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))
device = bench.launch_device()
step, rt, last = bench.case_step(case, device=device)
marks: list = []
on = [False]


def mark(label):
    if on[0]:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((label, time.perf_counter(), ev))


for i, block in enumerate(blocks(rt.model)):
    block.register_forward_pre_hook(lambda *_, i=i: mark(f"forward block {i}"))
for call in ("zero_grad", "forward_backward", "optimizer_step", "lr_scheduler_step"):
    fn = getattr(rt, call)

    def wrapped(*a, _fn=fn, _call=call, **k):
        mark(f"{_call} begins")
        out = _fn(*a, **k)
        mark(f"{_call} returns")
        return out
    setattr(rt, call, wrapped)

for _ in range(4):
    step()
torch.cuda.synchronize()
if dist.is_initialized():
    dist.barrier()
torch.cuda.synchronize()
ev0 = torch.cuda.Event(enable_timing=True)
ev0.record()
t0 = time.perf_counter()
on[0] = True
for _ in range(3):
    step()
on[0] = False
torch.cuda.synchronize()
rows = [(label, (h - t0) * 1e3, ev0.elapsed_time(ev)) for label, h, ev in marks]
starts = [i for i, r in enumerate(rows) if r[0] == "zero_grad begins"]
last_step = rows[starts[-1]:]
base_h, base_g = last_step[0][1], last_step[0][2]
if rank == 0:
    print(f"== {case}, rank {rank}: the last of 3 steps; ms from its start (host / GPU), lead = GPU - host")
    for label, h, g in last_step:
        print(f"{label:28s} host {h - base_h:8.2f}  gpu {g - base_g:8.2f}  lead {g - h:8.2f}")
    end = rows[-1]
    print(f"3 steps: host queued them in {end[1]:.1f} ms, the GPU ran them in {end[2]:.1f} ms")
if dist.is_initialized():
    dist.barrier()
for other in range(1, dist.get_world_size() if dist.is_initialized() else 1):
    if rank == other:
        leads = [g - h for label, h, g in last_step if label.startswith("forward block")]
        print(f"rank {rank}: forward-block leads {min(leads):.2f}..{max(leads):.2f} ms", flush=True)
    dist.barrier()
rt.close()
if dist.is_initialized():
    dist.destroy_process_group()
