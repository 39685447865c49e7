"""`mlite sbatch NAME [--dry-run]`: submit one of the Slurm templates in slurm/ (or print its launch).

NAME is a template in slurm/ (`grpo_dsv4_128gpu`, `sft`, ...; `--list` shows them) or a path to an .sbatch
file. Knobs travel as environment variables (`--env KEY=VALUE` or the caller's environment): sbatch passes
the environment to the job, and each template reads its knobs from it.

--dry-run prints the template, then runs it with DRY_RUN=1 outside Slurm: the planner checks the resolved
layout (exit 2 when it is invalid, 3 when it does not fit) and the resolved launch command and every srun
line are printed; nothing is submitted. Without --dry-run the template is submitted with `sbatch` from the
repository root (the templates find slurm/lib there) and the job id and log folder are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from mlite.errors import MliteError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "sbatch",
        help="submit a Slurm template from slurm/ (or --dry-run it)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", nargs="?", help="template name in slurm/ (e.g. grpo_dsv4_128gpu) or a path")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the script and its planner-checked launch"
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a knob for the job, e.g. --env CONFIG=jobs/my.yaml (repeatable)",
    )
    parser.add_argument("--list", action="store_true", help="list the templates and exit")
    parser.add_argument(
        "sbatch_args",
        nargs="*",
        metavar="-- SBATCH_ARG",
        help="extra arguments for sbatch after --, e.g. -- --nodes=4 --time=2:00:00",
    )
    parser.set_defaults(run=run)


def repo_root() -> Path:
    """The checkout holding slurm/ and launchers/: $MLITE_ROOT, else the one this package is installed
    from."""
    candidates = [Path(os.environ["MLITE_ROOT"])] if os.environ.get("MLITE_ROOT") else []
    candidates.append(Path(__file__).resolve().parents[2])
    for root in candidates:
        if (root / "slurm" / "lib" / "job.sh").is_file():
            return root
    raise MliteError(
        "the Slurm templates (slurm/) are not next to this mlite install; "
        "run from a checkout of the repository or set MLITE_ROOT to one"
    )


def list_templates(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "slurm").glob("*.sbatch"))


def resolve_template(root: Path, name: str) -> Path:
    path = Path(name)
    if path.suffix == ".sbatch" and path.is_file():
        return path.resolve()
    candidate = root / "slurm" / f"{path.stem if path.suffix == '.sbatch' else name}.sbatch"
    if candidate.is_file():
        return candidate
    raise MliteError(
        f"no Slurm template '{name}'; available: {', '.join(list_templates(root))} "
        "(or give a path to an .sbatch file)"
    )


def job_environment(pairs: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise MliteError(f"--env '{pair}' is not KEY=VALUE (e.g. --env CONFIG=jobs/my.yaml)")
        env[key] = value
    return env


def run(args) -> int:
    root = repo_root()
    if args.list or not args.name:
        print("\n".join(list_templates(root)))
        return 0
    template = resolve_template(root, args.name)
    env = job_environment(args.env)
    env["MLITE_ROOT"] = str(root)
    if args.dry_run:
        print(f"# ---- {template.relative_to(root) if template.is_relative_to(root) else template}")
        print(template.read_text(), end="", flush=True)
        print("# ---- DRY_RUN=1: the launch this job would run", flush=True)
        env["DRY_RUN"] = "1"
        env.setdefault("PYTHON_HERE", sys.executable)
        env.pop("SLURM_JOB_ID", None)  # a dry run inside an allocation still plans the template's own header
        return subprocess.run(["bash", str(template)], env=env, cwd=root, check=False).returncode
    if shutil.which("sbatch") is None:
        raise MliteError(
            "sbatch is not on PATH; submit from a Slurm login node, or start the local test cluster "
            "with `slurm/local/cluster.sh start`"
        )
    done = subprocess.run(
        ["sbatch", "--parsable", *args.sbatch_args, str(template)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise MliteError(f"sbatch refused {template.name}: {done.stderr.strip() or done.stdout.strip()}")
    job_id = done.stdout.strip().split(";")[0]
    print(
        f"submitted {template.name} as job {job_id}; batch log {root}/<job-name>-{job_id}.out, "
        f"node logs under $OUTPUT_ROOT/<job-name>-{job_id}/logs/"
    )
    return 0
