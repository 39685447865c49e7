"""`mlite plan`: validate a job's parallel layout, estimate memory per GPU and per node, recommend layouts.

Exit status: 0 the layout is valid and fits; 2 the input is invalid (one line on stderr: why and the fix);
3 the layout is valid but does not fit in GPU or host memory (the report says where). `--recommend` exits 0
when at least one layout fits and 3 when none does.
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_DOES_NOT_FIT = 3


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("plan",
                                   help="validate a layout, estimate memory, rank layouts (no GPU needed)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="job YAML file or packaged preset name (default: demo_sft)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set parallel.tp=4 (repeatable)")
    parser.add_argument("--recommend", action="store_true", help="enumerate and rank layouts that fit")
    parser.add_argument("--top", type=_at_least_one, default=5,
                        help="layouts shown by --recommend (default 5)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--list-models", action="store_true", help="list the model catalog and exit")
    parser.set_defaults(run=run)


def _at_least_one(text: str) -> int:
    """--top 0 would show no layout and then report that none fits."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def run(args) -> int:
    from rich.console import Console

    from mlite.config import load_job
    from mlite.errors import MliteError
    from mlite.plan import plan_job
    from mlite.plan.recommend import recommend
    from mlite.plan.report import models_table, plan_dict, render_candidates, render_plan

    console = Console(width=max(Console().width, 140))  # tables stay readable in pipes and CI logs
    if args.list_models:
        table, rows = models_table()
        _emit(console, args.json, rows, lambda: console.print(table))
        return 0
    job = load_job(args.config or "demo_sft", args.overrides)
    if args.recommend:
        candidates = recommend(job, top=args.top)
        c = job.cluster
        title = (f"layouts for {job.model.name or job.model.path} on {c.nodes} x {c.gpus_per_node} {c.gpu}, "
                 f"seq {job.data.seq_len}, {job.optimizer.backend} (best first)")
        _emit(console, args.json, [cand.as_dict() for cand in candidates],
              lambda: render_candidates(console, candidates, title))
        if not candidates:
            print("mlite plan: no layout fits; add GPUs, shorten data.seq_len or use a GPU with more memory",
                  file=sys.stderr)
            return EXIT_DOES_NOT_FIT
        return 0
    plan = plan_job(job, size_refused=True)  # a job the trainers refuse is still sized, then refused
    _emit(console, args.json, plan_dict(plan), lambda: render_plan(console, plan))
    if plan.refused is not None:
        raise MliteError(plan.refused)
    return 0 if plan.memory.fits else EXIT_DOES_NOT_FIT


def _emit(console, as_json: bool, data, render) -> None:
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        render()
