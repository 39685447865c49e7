"""The hang watchdog (trainer.hang_timeout_s, mlite.trainers.watchdog): a rank that makes no progress ends
the job with status 124, one line naming the rank and the phase, and every thread's stack on disk. The hang
is real: a GRPO reward that waits on a scoring server which never replies (tests/stuck_reward.py), or whose
module waits for it while it is imported, at start-up (tests/stuck_at_import_reward.py)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_grpo_cli import mlite_grpo, workdir, write_job  # noqa: F401 - workdir is a fixture

from mlite.trainers.watchdog import EXIT_HANG, Watchdog

TESTS = Path(__file__).parent


@pytest.fixture
def silent_server(monkeypatch):
    """A TCP server that takes connections (its backlog) and never answers them."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        monkeypatch.setenv("STUCK_REWARD_PORT", str(server.getsockname()[1]))
        monkeypatch.setenv("STUCK_REWARD_AFTER", "8")  # step 1's 2 prompts x 4 responses; step 2 hangs
        yield


def hung_job(workdir, out: Path, grpo: dict | None = None, startup_s: float = 300, **changes) -> Path:  # noqa: F811,E501
    """3 s a phase once the first step is done; the start-up (imports, the model: slow on a busy CI machine)
    and the first step get `startup_s`. No held-out prompts: the rewards are the steps' only."""
    grpo = {"reward": "stuck_reward:stuck_reward", "mini_batches": 2, **(grpo or {})}
    trainer = {"hang_timeout_s": 3, "startup_timeout_s": startup_s, "steps": 3}
    return write_job(workdir, out, data={"val_files": []}, trainer=trainer, grpo=grpo, **changes)


def test_a_rank_stuck_in_its_reward_ends_the_run_with_its_stack(workdir, tmp_path, silent_server,  # noqa: F811
                                                                monkeypatch):
    monkeypatch.setenv("STUCK_REWARD_RANKS", "0")
    began = time.monotonic()
    done = mlite_grpo(hung_job(workdir, tmp_path / "run"))
    assert done.returncode == EXIT_HANG, done.stderr[-3000:]
    assert time.monotonic() - began < 300  # 3 s past the last beat, not a hung process
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert re.search(r"mlite grpo: error: rank 0 made no progress for \d+ s "
                     r"\(trainer.hang_timeout_s=3\) in: step 2; every thread's stack is in \S+rank00000.txt",
                     errors[0]), errors[0]
    stacks = (tmp_path / "run" / "hang" / "rank00000.txt").read_text()
    assert stacks.startswith("rank 0: no progress for")
    assert "in stuck_reward" in stacks and "in score_responses" in stacks  # where it waits, by name


def test_a_start_up_that_hangs_is_watched_too(workdir, tmp_path, silent_server):  # noqa: F811
    """The watchdog runs from the start of train_grpo (and train_sft), not from the first step: here the
    reward module waits for its server while it is imported, when the trainer is built."""
    done = mlite_grpo(hung_job(workdir, tmp_path / "run", grpo={"reward": "stuck_at_import_reward:reward"},
                               startup_s=45))
    assert done.returncode == EXIT_HANG, done.stderr[-3000:]
    line = (r"error: rank 0 made no progress for \d+ s \(trainer.startup_timeout_s=45\) in: start-up: "
            r"the rollout engine, the reward and the reference policy;")
    assert re.search(line, done.stderr), done.stderr[-3000:]
    stacks = (tmp_path / "run" / "hang" / "rank00000.txt").read_text()
    assert "stuck_at_import_reward.py" in stacks and "in load_reward" in stacks


def test_two_ranks_end_when_one_waits_forever_and_the_other_in_a_collective(workdir, tmp_path,  # noqa: F811
                                                                            silent_server, monkeypatch):
    """At step 2 rank 1 waits on its reward server; rank 0 scores, then waits in the step's next collective
    for rank 1 (gloo's own timeout is 30 minutes). The launcher ends both within the watchdog's limit."""
    monkeypatch.setenv("STUCK_REWARD_RANKS", "1")
    config = hung_job(workdir, tmp_path / "run", cluster={"gpus_per_node": 2})
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2", "-m", "mlite", "grpo", str(config), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0 and time.monotonic() - began < 300, done.stderr[-3000:]
    line = r"mlite grpo: error: rank [01] made no progress for \d+ s"
    assert re.search(line, done.stderr), done.stderr[-3000:]
    dumps = {p.name: p.read_text() for p in (tmp_path / "run" / "hang").glob("rank*.txt")}
    assert dumps, "no rank wrote its stacks"
    if "rank00001.txt" in dumps:  # the launcher may end rank 1 before its own watchdog fires
        assert "in stuck_reward" in dumps["rank00001.txt"]
    if "rank00000.txt" in dumps:  # rank 0 is past its rewards, in the step
        assert "in stuck_reward" not in dumps["rank00000.txt"]


def test_a_rank_that_crashes_in_native_code_prints_its_python_stack(workdir, tmp_path,  # noqa: F811
                                                                    monkeypatch):
    """A segfault gives the launcher only a signal; the job's faulthandler says where it happened."""
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)  # the job's own, not the shell's
    done = mlite_grpo(write_job(workdir, tmp_path / "run", data={"val_files": []},
                                grpo={"reward": "crashing_reward:crash_in_native_code"}))
    assert done.returncode == -11, done.stderr[-3000:]  # SIGSEGV
    assert "Fatal Python error: Segmentation fault" in done.stderr, done.stderr[-3000:]
    where = re.search(r'crashing_reward\.py", line \d+ in crash_in_native_code', done.stderr)
    assert where and "in score_responses" in done.stderr, done.stderr[-3000:]


def test_beats_keep_it_quiet_the_start_up_has_its_own_limit_and_off_means_no_thread(tmp_path):
    with Watchdog(0.4, tmp_path, "sft", startup_s=None) as watch:
        assert watch.limit is None
        time.sleep(1.0)  # an unwatched start-up: 2.5 times the steady limit
        watch.settle()
        assert watch.limit == 0.4
        for step in range(8):  # 1.6 s of steps of 0.2 s: four times the limit, each within it
            watch.beat(f"step {step}")
            time.sleep(0.2)
    assert not (tmp_path / "hang").exists()
    with Watchdog(None, tmp_path, "sft") as off:
        assert off._thread is None
