"""`mlite sft CONFIG [--set key=value ...]`: supervised fine-tuning of a job (one process here; torchrun or
srun start one per GPU).

Resumes from the newest good checkpoint in trainer.output_dir when trainer.resume is auto (the default).
SIGTERM or SIGUSR1 saves a checkpoint at the next step boundary and exits 0, so a Slurm requeue continues.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("sft", help="supervised fine-tuning (resumable, checkpointed)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="job YAML file or packaged preset name")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set trainer.steps=100 (repeatable)")
    parser.add_argument("--no-progress", action="store_true", help="no progress display (metrics still logged)")
    parser.set_defaults(run=run)


def run(args) -> int:
    import logging

    from rich.console import Console

    from mlite.config import load_job
    from mlite.trainers.sft import print_summary, train_sft

    logging.basicConfig(level=logging.INFO, format="mlite sft: %(message)s")
    job = load_job(args.config, args.overrides)
    console = Console(stderr=True)
    result = train_sft(job, console=console, show_progress=not args.no_progress)
    if result.is_output_rank:
        print_summary(result, console)
    return 0
