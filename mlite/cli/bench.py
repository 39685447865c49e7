"""`mlite bench`: the trainers' step (the Runtime) next to the HF-transformers baseline, and torchtitan's step
with --titan (see mlite.bench)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="throughput / MFU / memory of mlite vs HF transformers",
                       description=__doc__)
    p.add_argument("cases", nargs="*", help="case names (default: the single-GPU cases); --list shows them")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--steps", type=int, default=8, help="timed steps per side (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--no-baseline", action="store_true", help="skip the HF-transformers side")
    p.add_argument("--titan", action="store_true",
                   help="also run torchtitan's side (its Qwen3 and float8) on the cases it builds; needs "
                        "torchtitan installed (not a dependency of mlite)")
    p.add_argument("--out", default="runs/bench/results.json", help="JSON results file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a job key for mlite's side, as for mlite sft (repeatable), e.g. --set "
                        "model.compile=false; multi-GPU cases take any key but their layout's (parallel.* "
                        "keys reach the parallel side only, the others its one-GPU reference too)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mlite.bench.cases import CASES
    from mlite.bench.report import detect_gpu, environment, render_table, write_results
    from mlite.bench.run import run_case, run_parallel_cases

    console = Console()
    if args.list:
        for case in CASES.values():
            console.print(f"{case.name:28s} {case.model:16s} seq {case.seq_len:6d} {case.packing:5s} "
                          f"gpus {case.gpus}")
        return 0
    names = _case_names(args)
    _check_titan(args, names)
    from mlite.cli.training import launcher_env

    multi = [n for n in names if CASES[n].gpus > 1]
    launch = launcher_env()
    world = launch["WORLD_SIZE"]
    device = _bench_device(args.device, multi, launch)
    rank0 = launch["RANK"] == 0
    if not rank0:
        console.quiet = True
    gpu, peak = detect_gpu(device)

    def say(line: str) -> None:  # rank 0's progress, on stderr: line-buffered, so a cut-off launch keeps it
        if rank0:
            print(f"  {line}", file=sys.stderr, flush=True)

    if multi:  # one launch: the N x one-GPU references first, then every case in its layout
        console.print(f"[bold]{', '.join(multi)}[/bold] on {world} x {gpu} ...")
        results = run_parallel_cases([CASES[n] for n in multi], device, steps=args.steps,
                                     warmup=args.warmup, gpu=gpu, peak_tflops=peak, overrides=args.overrides,
                                     say=say)
    else:
        results = []
        for name in names:
            console.print(f"[bold]{name}[/bold] on {gpu} ...")
            results += run_case(CASES[name], device, steps=args.steps, warmup=args.warmup,
                                sides=_sides(args), gpu=gpu,
                                peak_tflops=peak, overrides=args.overrides, say=say)
    if not rank0:
        return 0
    console.print(render_table(results))
    for r in results:
        if "scaling" in r.extra:
            console.print(f"{r.case}: {r.extra['scaling']:.1%} of {r.extra['world']} x one GPU; collectives "
                          f"measured at {r.extra['all_gather_bus_gbs']:.0f} GB/s all-gather, "
                          f"{r.extra['reduce_scatter_bus_gbs']:.0f} GB/s reduce-scatter (bus)")
    from pathlib import Path

    write_results(results, Path(args.out), environment(device))
    console.print(f"results: {args.out}")
    return 0


def _case_names(args: argparse.Namespace) -> list[str]:
    """The cases to run (default: the single-GPU ones), refused before anything is built when one is
    unknown, when --set would change a multi-GPU case's layout, or when one- and multi-GPU cases are mixed
    (they run under different launches)."""
    from mlite.bench.cases import CASES, LAYOUT_KEYS
    from mlite.errors import MliteError

    names = args.cases or [c.name for c in CASES.values() if c.gpus == 1 and c.name != "tiny-cpu"]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise MliteError(f"unknown bench case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    multi = [n for n in names if CASES[n].gpus > 1]
    fixed = [o for o in args.overrides if o.split("=", 1)[0].strip() in LAYOUT_KEYS]
    if multi and fixed:
        raise MliteError(f"--set {fixed[0]}: a multi-GPU case's name fixes its layout; pick the case of that "
                         "layout (mlite bench --list), --set takes other keys")
    if multi and len(multi) != len(names):
        raise MliteError("multi-GPU and one-GPU bench cases run in separate launches; "
                         "name one kind at a time")
    return names


def _sides(args: argparse.Namespace) -> tuple[str, ...]:
    return ("mlite",) + (() if args.no_baseline else ("hf",)) + (("torchtitan",) if args.titan else ())


def _check_titan(args: argparse.Namespace, names: list[str]) -> None:
    """--titan refused in one line before anything is built: where torchtitan is not importable (with the
    command that installs it) or the cases are multi-GPU ones (its side is one GPU's)."""
    if not args.titan:
        return
    from mlite.bench.cases import CASES
    from mlite.bench.titan_side import titan_missing
    from mlite.errors import MliteError

    if any(CASES[n].gpus > 1 for n in names):
        raise MliteError("--titan: torchtitan's side runs on one-GPU cases (mlite bench --list)")
    if missing := titan_missing():
        raise MliteError(missing)


def _bench_device(requested: str, multi: list[str], launch: dict[str, int]) -> str:
    """The device this rank benchmarks on (`--device`, auto: CUDA when visible): under a launch of several
    ranks, each on its local GPU; multi-GPU cases refused outside such a launch."""
    import torch

    from mlite.bench.cases import CASES
    from mlite.errors import MliteError

    if multi and launch["WORLD_SIZE"] == 1:
        gpus = CASES[multi[0]].gpus
        raise MliteError(f"case(s) {', '.join(multi)} run on several ranks: "
                         f"torchrun --nproc-per-node {gpus} -m mlite bench {' '.join(multi)}")
    device = requested if requested != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise MliteError("--device cuda but no CUDA GPU is visible; use --device cpu for the tiny case")
    if multi and device == "cuda":
        device = f"cuda:{launch['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    return device
