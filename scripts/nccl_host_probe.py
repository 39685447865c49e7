"""Host time of one NCCL all_gather_into_tensor and reduce_scatter_tensor of a 4-layer FSDP2 unit of
Qwen3-1.7B (201M bf16 elements), issued on a side stream: with the GPU idle (busy=0), behind 20 queued GEMMs
(busy=1), and with the side stream waiting on them (busy=2, as FSDP2 issues its collectives). The median of
10 calls per rank. CUDA only, 2 or more GPUs.

    torchrun --standalone --nproc-per-node 2 scripts/nccl_host_probe.py
"""

import os
import time

import torch
import torch.distributed as dist

UNIT = 201_000_000  # elements of a 4-layer unit of Qwen3-1.7B

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
bf16 = {"device": "cuda", "dtype": torch.bfloat16}
shard, gathered = torch.randn(UNIT // world, **bf16), torch.empty(UNIT // world * world, **bf16)
grads, reduced = torch.randn(UNIT // world * world, **bf16), torch.empty(UNIT // world, **bf16)
matrix = torch.randn(8192, 8192, **bf16)
side = torch.cuda.Stream()
for _ in range(3):
    dist.all_gather_into_tensor(gathered, shard)
    dist.reduce_scatter_tensor(reduced, grads)
torch.cuda.synchronize()


def host_ms(busy: int) -> tuple[float, float]:
    gather, scatter = [], []
    for _ in range(10):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        for _ in range(20 if busy else 0):
            matrix @ matrix  # about 20 ms queued on the compute stream
        with torch.cuda.stream(side):
            if busy == 2:
                side.wait_stream(torch.cuda.default_stream())
            start = time.perf_counter()
            dist.all_gather_into_tensor(gathered, shard)
            gather.append(time.perf_counter() - start)
            start = time.perf_counter()
            dist.reduce_scatter_tensor(reduced, grads)
            scatter.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(gather)[5] * 1e3, sorted(scatter)[5] * 1e3


for busy in (0, 1, 2):
    gather_ms, scatter_ms = host_ms(busy)
    print(f"rank {rank} busy={busy}: all_gather host {gather_ms:.3f} ms, "
          f"reduce_scatter host {scatter_ms:.3f} ms", flush=True)
dist.destroy_process_group()
