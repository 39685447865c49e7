"""The real local Slurm cluster for tests marked `slurm`: started through the project's own script
(slurm/local/cluster.sh: Debian's slurmctld + two slurmd, n1 and n2, on this machine), stopped at the end
when this session started it. Helpers submit with the real sbatch and wait on the real controller.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "slurm" / "local" / "cluster.sh"
VENV = Path(sys.prefix)  # jobs run in this interpreter's venv (CONTAINER=none)
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def _cluster(action: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CLUSTER), action], capture_output=True, text=True, timeout=timeout, check=False
    )


def local_cluster():
    """Body of a session fixture: `yield from local_cluster()`."""
    if os.geteuid() != 0:
        pytest.fail(
            "the slurm tests start a local Slurm cluster (slurm/local/cluster.sh) and need root; "
            "run them as root (CI does) or deselect them with -m 'not slurm'"
        )
    was_running = "slurmctld: running" in _cluster("status", 30).stdout
    started = _cluster("start", 600)  # installs the Debian packages the first time
    assert started.returncode == 0, f"cluster.sh start failed:\n{started.stdout}\n{started.stderr}"
    yield
    if not was_running:
        stopped = _cluster("stop", 120)
        assert stopped.returncode == 0, stopped.stderr


def job_state(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...); {} once the controller forgot it."""
    done = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return {}
    return dict(item.split("=", 1) for item in done.stdout.split() if "=" in item)


def submit(template: str, env: dict[str, str], *sbatch_args: str) -> str:
    """sbatch slurm/TEMPLATE.sbatch from the repository root with the knobs in env; returns the job id."""
    full_env = {**os.environ, "VENV": str(VENV), "CONTAINER": "none", **env}
    for name in [k for k in full_env if k.startswith("SLURM_")]:
        full_env.pop(name)
    done = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--gpus-per-node=0",
            *sbatch_args,
            str(ROOT / "slurm" / f"{template}.sbatch"),
        ],
        env=full_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def wait_for(job_id: str, timeout: float, until=lambda state: state.get("JobState") in FINAL_STATES) -> dict:
    """Polls the controller until `until(state)` holds; fails the test (and cancels the job) at the
    deadline."""
    deadline = time.monotonic() + timeout
    state: dict[str, str] = {}
    while time.monotonic() < deadline:
        state = job_state(job_id) or state
        if state and until(state):
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], check=False)
    pytest.fail(f"job {job_id} not done within {timeout:.0f}s; last state {state.get('JobState')}")
