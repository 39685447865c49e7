"""Invoke tasks: thin wrappers over the `mlite` CLI and the test runner. Logic lives in the package.

    invoke --list          every task
    invoke demo            tiny SFT + GRPO run on CPU with generated data (--no-grpo: SFT only)
    invoke test            the CPU test suite (what CI runs); --gpu for the GPU suite
"""

from __future__ import annotations

import shlex
import sys

from invoke import task

PY = shlex.quote(sys.executable)


def _mlite(c, *args: str) -> None:
    """Run `mlite ARGS` in this interpreter; its exit status (2 for user errors) becomes ours."""
    cmd = " ".join([PY, "-m", "mlite", *map(shlex.quote, args)])
    result = c.run(cmd, warn=True, pty=False)
    if result.exited:
        sys.exit(result.exited)


def _overrides(set_: list[str] | None) -> list[str]:
    return [f"--set={item}" for item in (set_ or [])]


@task(
    help={
        "gpu": "run the GPU suite (tests marked gpu; fails if no GPU is visible)",
        "k": "pytest -k expression",
        "workers": "parallel pytest workers (default 2)",
        "extra": "extra pytest arguments, quoted",
    }
)
def test(c, gpu=False, k="", workers=2, extra=""):
    """Run the test suite (CPU by default: what CI runs)."""
    # --durations: the slowest tests in every run's log, where a slower suite shows what grew
    args = [PY, "-m", "pytest", "-m", "gpu" if gpu else "not gpu", "--durations=25"]
    if workers > 1:
        args += ["-n", str(workers), "--dist", "loadgroup"]
    if k:
        args += ["-k", k]
    if extra:
        args += shlex.split(extra)
    result = c.run(shlex.join(args), warn=True, pty=False)
    sys.exit(result.exited)


@task(
    help={
        "cases": "comma-separated case names (default: every single-GPU case); "
                 "`mlite bench --list` shows them",
        "steps": "timed steps per side",
        "device": "auto | cpu | cuda",
        "no_baseline": "skip the HF-transformers side",
        "titan": "add torchtitan's side to the cases it builds (torchtitan installed: docs/PERFORMANCE.md)",
        "out": "JSON results file",
    }
)
def bench(c, cases="", steps=8, device="auto", no_baseline=False, titan=False, out="runs/bench/results.json"):
    """The trainers' step (the Runtime) vs HF transformers (and torchtitan): tokens/s, MFU, peak memory vs
    the planner."""
    args = ["bench", *[n for n in cases.split(",") if n], f"--steps={steps}", f"--device={device}",
            f"--out={out}"]
    _mlite(c, *args, *(["--no-baseline"] if no_baseline else []), *(["--titan"] if titan else []))


@task(
    help={
        "config": "job YAML file or packaged preset name",
        "set_": "override key.sub=value (repeatable)",
        "recommend": "enumerate and rank valid layouts instead of checking one",
        "json": "machine-readable output",
    },
    iterable=["set_"],
)
def plan(c, config="", set_=None, recommend=False, json=False):
    """Validate a parallel layout and estimate memory per GPU and per node (no GPU needed)."""
    args = ["plan"] + ([config] if config else []) + _overrides(set_)
    args += ["--recommend"] if recommend else []
    args += ["--json"] if json else []
    _mlite(c, *args)


@task(
    help={"config": "GRPO job YAML file or packaged preset name",
          "set_": "override key.sub=value (repeatable)",
          "no_progress": "plain log lines instead of a progress bar"},
    iterable=["set_"],
)
def grpo(c, config, set_=None, no_progress=False):
    """GRPO on the mlite runtime, rolling out with the built-in sampler or vLLM (planner checks first)."""
    _mlite(c, "grpo", config, *_overrides(set_), *(["--no-progress"] if no_progress else []))


@task(
    help={"out": "output folder (default runs/demo)", "device": "auto, cpu or cuda",
          "set_": "override a key of the demo's SFT job, key.sub=value (repeatable)",
          "grpo_set": "override a key of the demo's GRPO job, key.sub=value (repeatable)",
          "no_grpo": "stop after SFT",
          "no_progress": "plain log lines instead of a progress bar"},
    iterable=["set_", "grpo_set"],
    auto_shortflags=False,  # --no-grpo and --no-progress would both want -n
)
def demo(c, out="runs/demo", device="auto", set_=None, grpo_set=None, no_grpo=False, no_progress=False):
    """Generate data and a tokenizer, train a tiny Qwen3-style model with SFT, then GRPO from it
    (CPU: minutes)."""
    _mlite(c, "demo", "--out", out, "--device", device, *_overrides(set_),
           *[f"--grpo-set={item}" for item in (grpo_set or [])],
           *(["--no-grpo"] if no_grpo else []), *(["--no-progress"] if no_progress else []))


@task(
    help={"config": "SFT job YAML file or packaged preset name",
          "set_": "override key.sub=value (repeatable)",
          "no_progress": "plain log lines instead of a progress bar"},
    iterable=["set_"],
)
def sft(c, config, set_=None, no_progress=False):
    """Supervised fine-tuning; resumes from the newest good checkpoint in trainer.output_dir."""
    _mlite(c, "sft", config, *_overrides(set_), *(["--no-progress"] if no_progress else []))


@task(help={"checkpoint": "training checkpoint dir or a run's output dir", "out": "new HF checkpoint dir",
            "dtype": "fp32 (default), bf16 or fp16"})
def export(c, checkpoint, out, dtype=""):
    """Write an HF safetensors checkpoint (transformers loads it) from a training checkpoint."""
    _mlite(c, "export", checkpoint, "--out", out, *(["--dtype", dtype] if dtype else []))


# ------------------------------------------------------------------------------------ container images
# Logic and command construction live in mlite/images/build.py (tested there); these only pass arguments.
_IMAGE_HELP = {
    "arch": "GPU architecture: sm90 (Hopper) or sm100 (Blackwell)",
    "stack": "stack version from docker/stacks/ (default: the newest)",
    "target": "image stage: runtime or dev",
    "image": "image repository for the tag (default: $MLITE_IMAGE or mlite)",
    "dry_run": "print the exact docker command without running it (no engine needed)",
}


def _images(action: str, **kwargs) -> None:
    from mlite.images import build as images

    sys.exit(images.main(action, **kwargs))


@task(help={**_IMAGE_HELP, "push": "push the image after building it",
            "cache_ref": "registry ref for the build cache (default: a local folder)"})
def build(c, arch, stack="", target="runtime", push=False, dry_run=False, image="", cache_ref=""):
    """Build the mlite image for one GPU architecture with docker buildx (pins from docker/stacks/)."""
    _images("build", arch=arch, stack=stack or None, target=target, push=push, dry_run=dry_run,
            image=image or None, cache_ref=cache_ref or None)


@task(help=_IMAGE_HELP)
def push(c, arch, stack="", target="runtime", dry_run=False, image=""):
    """Push the image tagged for this arch and stack."""
    _images("push", arch=arch, stack=stack or None, target=target, dry_run=dry_run, image=image or None)


@task(help=_IMAGE_HELP)
def pull(c, arch, stack="", target="runtime", dry_run=False, image=""):
    """Pull the prebuilt image tagged for this arch and stack."""
    _images("pull", arch=arch, stack=stack or None, target=target, dry_run=dry_run, image=image or None)


@task(help={**_IMAGE_HELP, "target": "image stage: dev (default) or runtime",
            "command": "command to run in the container (default: bash)",
            "tty": "attach a terminal (--no-tty in CI)"})
def shell(c, arch, stack="", target="dev", dry_run=False, image="", command="bash", tty=True):
    """Open a shell in the image on all GPUs with the repository at /workspace (prints the docker run)."""
    _images("shell", arch=arch, stack=stack or None, target=target, dry_run=dry_run, image=image or None,
            command=command, tty=tty)


@task(help={"stack": "stack version (default: $MLITE_STACK, else the newest)", "arch": "sm90 or sm100",
            "strict": "exit 1 when anything is missing or wrong",
            "require_gpu": "a missing GPU is a problem"})
def doctor(c, stack="", arch="", strict=False, require_gpu=False):
    """Check this environment against a stack's pins: versions, imports, GPU arch, NCCL, cuDNN DSA."""
    args = ["doctor"] + ([f"--stack={stack}"] if stack else []) + ([f"--arch={arch}"] if arch else [])
    args += ["--strict"] if strict else []
    args += ["--require-gpu"] if require_gpu else []
    _mlite(c, *args)


@task(
    help={
        "name": "template in slurm/ (grpo_dsv4_128gpu, sft, ...) or a path to an .sbatch file",
        "dry_run": "print the script and its planner-checked launch; submit nothing",
        "env": "a knob for the job, KEY=VALUE (repeatable)",
    },
    iterable=["env"],
)
def sbatch(c, name, dry_run=False, env=None):
    """Submit a Slurm template (or --dry-run: print it and the resolved, planner-checked launch)."""
    args = ["sbatch", name] + [f"--env={item}" for item in (env or [])]
    args += ["--dry-run"] if dry_run else []
    _mlite(c, *args)
