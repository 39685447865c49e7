"""Host time of each Runtime call of a bench step, the GPU idle (and every rank at a barrier) at each call's
start: the median of 5 steps per call, then one step under cProfile on rank 0, by cumulative time. CUDA only.
A call that queues more launches than CUDA's queue holds also counts the time its launches waited for the
GPU, so compare a call's host time with its GPU time (`scripts/host_lead.py`) before calling it host-bound.

    torchrun --standalone --nproc-per-node 2 scripts/host_profile.py dense-1.7b-4k-dp2
    python3 scripts/host_profile.py dense-1.7b-4k
"""

import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

from mlite import bench

CALLS = ("zero_grad", "forward_backward", "optimizer_step", "lr_scheduler_step")

case = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))
device = bench.launch_device()
step, rt, _last = bench.case_step(case, device=device)
mode = {"now": None}  # None: untimed; "time": host times; "profile": host times under cProfile
host_ms: dict[str, list[float]] = {}
profiles: dict[str, cProfile.Profile] = {}


def idle() -> None:
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
        torch.cuda.synchronize()


for call in CALLS:
    def wrapped(*args, _fn=getattr(rt, call), _call=call, **kwargs):
        if mode["now"] is None:
            return _fn(*args, **kwargs)
        idle()
        profile = cProfile.Profile() if mode["now"] == "profile" else None
        if profile:
            profile.enable()
        start = time.perf_counter()
        out = _fn(*args, **kwargs)
        host_ms.setdefault(_call, []).append((time.perf_counter() - start) * 1e3)
        if profile:
            profile.disable()
            profiles[_call] = profile
        return out
    setattr(rt, call, wrapped)

for _ in range(4):
    step()
mode["now"] = "time"
for _ in range(5):
    step()
torch.cuda.synchronize()
print(f"rank {rank} host ms per call (median of 5, GPU idle at start): "
      + ", ".join(f"{call} {sorted(ms)[2]:.2f}" for call, ms in host_ms.items()), flush=True)
mode["now"] = "profile"
step()
torch.cuda.synchronize()
if rank == 0:
    for call in ("forward_backward", "optimizer_step"):
        text = io.StringIO()
        pstats.Stats(profiles[call], stream=text).sort_stats("cumtime").print_stats(40)
        print(f"===== {case} {call}\n{text.getvalue()}")
rt.close()
if dist.is_initialized():
    dist.destroy_process_group()
