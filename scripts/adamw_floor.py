"""How far the optimizer step is from its memory-bandwidth floor, on one GPU.

For the parameters of a bench case (bf16 parameters, gradients and AdamW states, as the bench runs), the
update reads parameter, gradient and both moments and writes parameter and both moments back: 14 bytes per
parameter. The floor is those bytes at the GPU's measured copy bandwidth (a large device-to-device copy,
read + write). Prints the floor, each AdamW implementation's median step and its ratio to the floor:
torch's fused and foreach, TritonAdamW (mlite.runtime.kernels.adamw, what LocalAdamW runs on one GPU; its
`host_ms` is the CPU time of one step call, which the GPU waits for when the step follows a host sync), and
torch's fused over one flat buffer. --sweep also times TritonAdamW's kernel configurations. --fp8 also times
Fp8StateAdamW (precision.optimizer_state: fp8), whose floor is 10 bytes per parameter plus the block scales
(read and write 2 x 4 bytes per 128), with and without stochastic rounding. Both are also timed as the
trainer calls them: with clipping's factor and the non-finite skip flag (`clip+skip`). The gradients are
random, except that an untied input embedding's are zero outside 4096 random rows, as in a training step.

    python scripts/adamw_floor.py moe-30b-a3b-6l-4k dense-1.7b-4k dsv4-flash-4l-4k [--fp8] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mlite.bench import CASES, case_arch
from mlite.runtime.kernels.adamw import FP8_BLOCK, Fp8StateAdamW, TritonAdamW
from mlite.runtime.models import build_model

# (chunk, block, num_warps) that --sweep tries besides TritonAdamW's default
SWEEP = [(65536, 1024, 4), (65536, 4096, 8), (65536, 4096, 16), (16384, 2048, 8), (262144, 2048, 8)]


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


def host_ms(fn, repeats: int = 5) -> float:
    """CPU time of one call that only queues GPU work (synchronised before each)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e3


def time_triton(params, floor_ms: float, sweep: bool) -> dict:
    opt = TritonAdamW(params, lr=1e-5, weight_decay=0.1, fused=True)
    opt.step()
    if not opt._tables:
        return {"error": "TritonAdamW fell back to torch's step (no triton?)"}
    ms = median_ms(opt.step)
    coef, found_inf = torch.tensor(0.5, device="cuda"), torch.tensor(0.0, device="cuda")
    step = opt.step
    trainer_ms = median_ms(lambda: step(grad_coef=coef, found_inf=found_inf))  # the trainer's call
    row = {"ms": round(ms, 2), "x_floor": round(ms / floor_ms, 2), "host_ms": round(host_ms(opt.step), 2),
           "clip+skip_ms": round(trainer_ms, 2),
           "launches": sum(len(launches) for launches, _ in opt._tables.values()),
           "config": [opt.chunk, opt.block, opt.num_warps]}
    if sweep:
        row["sweep"] = {}
        for chunk, block, num_warps in SWEEP:
            opt.chunk, opt.block, opt.num_warps = chunk, block, num_warps
            ms = median_ms(opt.step)
            row["sweep"][f"chunk={chunk} block={block} warps={num_warps}"] = {
                "ms": round(ms, 2), "x_floor": round(ms / floor_ms, 2)}
    del opt
    torch.cuda.empty_cache()
    return row


def time_fp8(params, bandwidth: float, sweep: bool) -> dict:
    count = sum(p.numel() for p in params)
    floor_ms = (10 + 16 / FP8_BLOCK) * count / (bandwidth * 1e9) * 1e3
    opt = Fp8StateAdamW(params, lr=1e-5, weight_decay=0.1, fused=True)
    opt.step()
    if not opt._tables:
        return {"error": "Fp8StateAdamW fell back to torch's step (no triton?)"}
    row = {"floor_ms": round(floor_ms, 2)}
    configs = [(opt.block, opt.num_warps)] + ([(1024, 4), (1024, 8), (2048, 4), (4096, 8), (4096, 16)]
                                              if sweep else [])
    default = configs[0]
    # the trainer's call: clipping's factor and the non-finite skip flag, both on the device
    coef, found_inf = torch.tensor(0.5, device="cuda"), torch.tensor(0.0, device="cuda")
    step = opt.step
    for label, kwargs in (("clip", {"grad_coef": coef}), ("skip", {"found_inf": found_inf}),
                          ("clip+skip", {"grad_coef": coef, "found_inf": found_inf})):
        ms = median_ms(lambda kwargs=kwargs: step(**kwargs))
        row[f"stochastic {label}"] = {"ms": round(ms, 2), "x_floor": round(ms / floor_ms, 2)}
    for stochastic in (True, False):
        opt.stochastic = stochastic
        for block, num_warps in configs:
            opt.block, opt.num_warps = block, num_warps
            ms = median_ms(opt.step)
            label = f"{'stochastic' if stochastic else 'half up'} block={block} warps={num_warps}"
            row[label] = {"ms": round(ms, 2), "x_floor": round(ms / floor_ms, 2)}
    opt.block, opt.num_warps = default
    del opt
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--sweep", action="store_true", help="also time other TritonAdamW configurations")
    parser.add_argument("--fp8", action="store_true", help="also time Fp8StateAdamW (e4m3 moments)")
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
        # as in a training step: the input embedding's gradient is zero outside the rows of the batch's
        # tokens (one 4096-token sequence of random ids, as the bench's). Untied models only; zeros send
        # IEEE division and square root down their slow paths, which a kernel bound by its arithmetic pays
        embed = model.embed.weight
        if not arch.tie_embeddings:  # a tied LM head's gradient fills every row
            used = torch.zeros(embed.shape[0], dtype=torch.bool, device="cuda")
            used[torch.randint(embed.shape[0], (4096,), device="cuda")] = True
            embed.grad[~used] = 0
        count = sum(p.numel() for p in params)
        floor_ms = 14 * count / (bandwidth * 1e9) * 1e3
        row = {"parameters": count, "floor_ms": round(floor_ms, 2)}
        for label, options in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
            opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.1, **options)
            ms = median_ms(opt.step)
            row[label] = {"ms": round(ms, 2), "x_floor": round(ms / floor_ms, 2)}
            if label == "fused":
                row[label]["host_ms"] = round(host_ms(opt.step), 2)
            del opt
            torch.cuda.empty_cache()
        row["triton"] = time_triton(params, floor_ms, args.sweep)
        if args.fp8:
            row["fp8"] = time_fp8(params, bandwidth, args.sweep)
            print(f"{name} fp8: {json.dumps(row['fp8'])}", flush=True)
        timed = [k for k in ("fused", "foreach", "triton") if "ms" in row[k]]
        print(f"{name}: {count / 1e9:.2f}B parameters in {len(params)} tensors, floor {floor_ms:.2f} ms; "
              + ", ".join(f"{k} {row[k]['ms']} ms ({row[k]['x_floor']}x)" for k in timed), flush=True)
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
