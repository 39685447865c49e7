"""How far the optimizer step is from its memory-bandwidth floor (issue 15), on one GPU.

For the parameters of a bench case (bf16 parameters, gradients and AdamW states, as the bench runs), the
update reads parameter, gradient and both moments and writes parameter and both moments back: 14 bytes per
parameter. The floor is those bytes at the GPU's measured copy bandwidth (a large device-to-device copy,
read + write). Prints the floor, each AdamW implementation's median step and its ratio to the floor.

    python scripts/adamw_floor.py moe-30b-a3b-6l-4k dense-1.7b-4k
"""

from __future__ import annotations

import argparse
import json

import torch

from mlite.bench import CASES, case_arch
from mlite.runtime.models import build_model


def median_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(gib: float = 4.0) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), repeats=10)
    return 2 * gib * 2**30 / (ms / 1e3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbs()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "copy_bandwidth_gbs": round(bandwidth, 1), "cases": {}}
    for name in args.cases:
        arch = case_arch(CASES[name])
        model = build_model(arch, dtype=torch.bfloat16, device="cuda", init=False)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        count = sum(p.numel() for p in params)
        floor_ms = 14 * count / (bandwidth * 1e9) * 1e3
        row = {"parameters": count, "floor_ms": round(floor_ms, 2)}
        for label, options in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
            opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.1, **options)
            ms = median_ms(opt.step)
            row[label] = {"ms": round(ms, 2), "x_floor": round(ms / floor_ms, 2)}
            del opt
            torch.cuda.empty_cache()
        # the same update over one flat buffer (parameters as views of it): what flattening would give
        del params
        model.to("meta")
        torch.cuda.empty_cache()
        flat = torch.zeros(count, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        flat.grad = torch.randn_like(flat) * 1e-3
        opt = torch.optim.AdamW([flat], lr=1e-5, weight_decay=0.1, fused=True)
        ms = median_ms(opt.step)
        row["fused_flat"] = {"ms": round(ms, 2), "x_floor": round(ms / floor_ms, 2)}
        del opt, flat
        torch.cuda.empty_cache()
        results["cases"][name] = row
        del model
        torch.cuda.empty_cache()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
