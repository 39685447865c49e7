"""Measure the host time FSDP2 adds to a training step, per unit and per parameter (gloo, any machine).

What FSDP2 costs the host per training step, apart from any GPU or network: a stack of tiny blocks
(compute negligible) trained on one CPU rank (gloo), with and without `fully_shard`, and with the blocks
grouped several to a unit. Reports the host time FSDP2 adds per step, per unit and per parameter.

The added time falls with fewer, larger units (on an H100 host 46.7, 35.8 and 27.7 ms a step with 29, 15
and 8 units; docs/PERFORMANCE.md, "What the defaults rest on") and grows with the parameters a unit holds:
fewer, larger parameters (fused projections) or a flat-buffer data-parallel path take it down further.

    python3 scripts/fsdp_host_probe.py [--blocks 28] [--linears 4 8] [--group 1 2 4] [--keep-gathered]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

WIDTH = 16


class Block(nn.Module):
    """`linears` tiny projections in a residual chain, plus one norm: 1 + linears parameters."""

    def __init__(self, linears: int):
        super().__init__()
        self.norm = nn.RMSNorm(WIDTH)
        self.projections = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(linears))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        for projection in self.projections:
            h = projection(h)
        return x + h


def host_ms(blocks: int, linears: int, group: int, mesh, steps: int = 20, reshard: bool = True,
            prefetch: bool = False) -> float:
    """Milliseconds per forward + backward; group 0: the plain model. `reshard`: FSDP2's
    reshard_after_forward (parallel.fsdp_reshard_after_forward); `prefetch`: each unit names the next for
    FSDP2's forward prefetch (parallel.fsdp_forward_prefetch)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(linears) for _ in range(blocks)])
    if group:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        layers = list(model)
        units = []
        for i in range(0, blocks, group):
            unit = fully_shard(layers[i : i + group] if group > 1 else layers[i], mesh=mesh, mp_policy=policy,
                               reshard_after_forward=reshard)
            units.append(unit[0] if group > 1 else unit)
        if prefetch:
            for unit, following in zip(units, units[1:]):
                unit.set_modules_to_forward_prefetch([following])
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    x = torch.randn(8, WIDTH, dtype=torch.bfloat16 if group else torch.float32)

    def step():
        model(x).float().sum().backward()

    for _ in range(3):
        step()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - began) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=28)
    parser.add_argument("--linears", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--group", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--keep-gathered", action="store_true",
                        help="also each grouping kept gathered from forward to backward, with and without "
                             "the forward prefetch (the defaults of parallel.fsdp_reshard_after_forward auto "
                             "and parallel.fsdp_forward_prefetch)")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1,))
    for linears in args.linears:
        plain = host_ms(args.blocks, linears, 0, mesh)
        params = args.blocks * (linears + 1)
        print(f"{args.blocks} blocks x {linears + 1} parameters: plain {plain:.1f} ms/step")
        for group in args.group:
            added = host_ms(args.blocks, linears, group, mesh) - plain
            units = -(-args.blocks // group) + 1
            print(f"  FSDP2, {group} block(s) a unit ({units} units): +{added:.1f} ms/step, "
                  f"{added / units:.2f} ms a unit, {added / params * 1e3:.0f} us a parameter")
            if args.keep_gathered:
                for prefetch in (False, True):
                    kept = host_ms(args.blocks, linears, group, mesh, reshard=False, prefetch=prefetch)
                    kept -= plain
                    print(f"    kept gathered{', prefetched' if prefetch else ''}: +{kept:.1f} ms/step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
