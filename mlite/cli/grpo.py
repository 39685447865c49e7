"""`mlite grpo CONFIG [--set key=value ...]`: GRPO on the mlite runtime with the built-in rollout.

The planner checks the job first (layout, rollout lengths, memory); then rollouts -> rewards -> PPO
updates, with metrics (JSONL, TensorBoard, PNG), progress, checkpoints and resume (trainer.resume: auto).
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "grpo",
        help="GRPO reinforcement learning (built-in rollout, resumable)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="job YAML file or packaged preset name")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set grpo.kl_coef=0.01 (repeatable)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress display (metrics still logged)"
    )
    parser.set_defaults(run=run)


def run(args) -> int:
    import logging

    from rich.console import Console

    from mlite.config import load_job
    from mlite.errors import MliteError
    from mlite.plan import plan_job

    job = load_job(args.config, args.overrides)
    if job.job != "grpo":
        raise MliteError(
            f"{args.config} is a '{job.job}' job; run it with `mlite {job.job}` or set job: grpo"
        )
    plan = plan_job(job)  # an invalid layout stops here with the planner's one-line reason
    if not plan.memory.fits:
        raise MliteError(
            f"the job needs {plan.memory.total_gb:.1f} GB per GPU, over the usable "
            f"{plan.memory.usable_gb:.1f} GB; see `mlite plan {args.config} --recommend`"
        )

    from mlite.trainers.grpo.trainer import print_summary, train_grpo

    logging.basicConfig(level=logging.INFO, format="mlite grpo: %(message)s")
    console = Console(stderr=True)
    result = train_grpo(job, console=console, show_progress=not args.no_progress)
    print_summary(result, console)
    return 0
