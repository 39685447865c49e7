"""What `mlite sft` and `mlite grpo` share: the job's parser, the planner before start and the run."""

from __future__ import annotations

import argparse
import os


def add_training_parser(subparsers, kind: str, help: str, doc: str, example: str) -> None:
    parser = subparsers.add_parser(kind, help=help, description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="job YAML file or packaged preset name")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a config key, e.g. --set {example} (repeatable)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress display (metrics still logged)")
    parser.set_defaults(run=lambda args: run_training(kind, args))


# What torchrun sets, with the least each may be: int() of a stray value was a traceback deep in the
# start-up (the planner, the device choice, the watchdog)
LAUNCHER_VARS = {"WORLD_SIZE": 1, "RANK": 0, "LOCAL_RANK": 0}


def launcher_env() -> dict[str, int]:
    """WORLD_SIZE, RANK and LOCAL_RANK as numbers (1, 0, 0 when unset); a value that is not one is refused."""
    from mlite.errors import MliteError

    values = {}
    for name, least in LAUNCHER_VARS.items():
        raw = os.environ.get(name, str(least))
        try:
            values[name] = int(raw)
        except ValueError:
            values[name] = least - 1
        if values[name] < least:
            raise MliteError(f"environment variable {name}={raw!r} is not a whole number >= {least}; "
                             "unset it or launch with torchrun, which sets it")
    return values


def plan_for_this_world(job):
    """The planner's verdict on the job as this process group will run it: the world size torchrun or
    srun gave (WORLD_SIZE; one process without it), not only the one the job's cluster section names.
    A layout the planner refuses stops here, in one line, before any model is built; so does a job that
    does not fit in GPU memory."""
    from mlite.errors import MliteError
    from mlite.plan import plan_job
    from mlite.plan.memory import HEADROOM

    world = launcher_env()["WORLD_SIZE"]
    cluster = job.cluster
    if world != cluster.world_size:
        nodes = world // cluster.gpus_per_node if world % cluster.gpus_per_node == 0 else 1
        job = job.model_copy(update={"cluster": cluster.model_copy(
            update={"nodes": nodes, "gpus_per_node": world // nodes})})
    plan = plan_job(job)
    mem = plan.memory
    if mem.total_gb > mem.usable_gb:
        raise MliteError(f"the job needs {mem.total_gb:.1f} GB per GPU, over the usable "
                         f"{mem.usable_gb:.1f} GB; see `mlite plan CONFIG --recommend`")
    if not mem.fits:  # the host's share: offloaded state and each rank's process
        raise MliteError(f"the job needs {mem.host_total_gb:.1f} GB of host memory per node, over the usable "
                         f"{mem.host_capacity_gb * HEADROOM:.1f} GB of cluster.host_memory_gb="
                         f"{mem.host_capacity_gb:g}; raise cluster.host_memory_gb or offload less")
    return plan


def run_training(kind: str, args) -> int:
    import logging

    from mlite.config import load_job
    from mlite.errors import MliteError
    from mlite.trainers.metrics import stream_console

    launcher_env()  # before the job: a bad launch is the first thing to fix
    job = load_job(args.config, args.overrides)
    if job.job != kind:
        raise MliteError(f"{args.config} is a '{job.job}' job; run it with `mlite {job.job}` "
                         f"or set job: {kind}")
    plan_for_this_world(job)
    logging.basicConfig(level=logging.INFO, format=f"mlite {kind}: %(message)s")
    console = stream_console()
    if kind == "sft":
        from mlite.trainers.sft import train_sft as train
    else:
        from mlite.trainers.grpo.trainer import train_grpo as train
    from mlite.trainers.loop import print_summary

    print_summary(train(job, console=console, show_progress=not args.no_progress), console)
    return 0
