"""`mlite sft CONFIG [--set key=value ...]`: supervised fine-tuning of a job (one process here; torchrun or
srun start one per GPU).

The planner checks the job first (layout, memory) for the world this run has. Resumes from the newest good
checkpoint in trainer.output_dir when trainer.resume is auto (the default). SIGTERM or SIGUSR1 saves a
checkpoint at the next step boundary and exits 0, so a Slurm requeue continues.
"""

from __future__ import annotations

from mlite.cli.training import add_training_parser


def add_parser(subparsers) -> None:
    add_training_parser(subparsers, "sft", "supervised fine-tuning (resumable, checkpointed)", __doc__,
                        "trainer.steps=100")
