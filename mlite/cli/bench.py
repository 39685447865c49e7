"""`mlite bench`: mlite's training step next to the HF-transformers baseline (see mlite.bench)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="throughput / MFU / memory of mlite vs HF transformers",
                       description=__doc__)
    p.add_argument("cases", nargs="*", help="case names (default: the single-GPU cases); --list shows them")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--steps", type=int, default=8, help="timed steps per side (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--no-baseline", action="store_true", help="skip the HF-transformers side")
    p.add_argument("--no-compile", action="store_true", help="do not torch.compile the decoder blocks")
    p.add_argument("--out", default="runs/bench/results.json", help="JSON results file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mlite import bench
    from mlite.errors import MliteError

    console = Console()
    if args.list:
        for case in bench.CASES.values():
            console.print(f"{case.name:28s} {case.model:16s} seq {case.seq_len:6d} {case.packing:5s} gpus {case.gpus}")
        return 0
    names = args.cases or [c.name for c in bench.CASES.values() if c.gpus == 1 and c.name != "tiny-cpu"]
    unknown = [n for n in names if n not in bench.CASES]
    if unknown:
        raise MliteError(f"unknown bench case(s) {', '.join(unknown)}; known: {', '.join(bench.CASES)}")
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise MliteError("--device cuda but no CUDA GPU is visible; use --device cpu for the tiny case")
    gpu, peak = bench.detect_gpu(device)
    multi = [n for n in names if bench.CASES[n].gpus > 1]
    if multi:
        raise MliteError(f"case(s) {', '.join(multi)} need several GPUs and the parallel runtime; "
                         "this version of mlite bench runs single-GPU cases only (see docs/PERFORMANCE.md)")
    results = []
    for name in names:
        console.print(f"[bold]{name}[/bold] on {gpu} ...")
        results += bench.run_case(bench.CASES[name], device, steps=args.steps, warmup=args.warmup,
                                  sides=("mlite",) if args.no_baseline else ("mlite", "hf"),
                                  compile_blocks=not args.no_compile, gpu=gpu, peak_tflops=peak)
    console.print(bench.render_table(results))
    from pathlib import Path

    bench.write_results(results, Path(args.out), bench.environment(device))
    console.print(f"results: {args.out}")
    return 0
