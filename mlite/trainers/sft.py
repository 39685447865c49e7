"""Supervised fine-tuning on the runtime: one step of the shared loop (mlite.trainers.loop).

    result = train_sft(job)

Each step takes this rank's micro-batches of packed sequences and the global number of target tokens,
accumulates gradients (loss = summed token NLL / global target tokens, exact over micro-batches and
ranks), clips, steps AdamW and the LR schedule. The loop logs, checkpoints (the data position is this
trainer's extra state, so a resumed run continues bitwise) and resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.runtime.data.sft import build_sft_data
from mlite.runtime.engine import Runtime
from mlite.runtime.loss import sft_loss
from mlite.trainers import loop
from mlite.trainers.common import first_rank
from mlite.trainers.metrics import PLOT_FILE, read_metrics
from mlite.trainers.run_folder import RunLock, check_output_dir
from mlite.trainers.watchdog import Watchdog


@dataclass
class SFTResult(loop.RunResult):
    data_report: dict = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in read_metrics(self.metrics_path) if "loss" in r]



class SFTTrainer:
    name, plot_keys, plot_file, eval_at_start = "sft", ("loss", "val_loss"), PLOT_FILE, False

    def __init__(self, job: JobConfig, runtime: Runtime):
        self.runtime = runtime
        self.data = build_sft_data(job, runtime.dp_rank, runtime.dp_size)

    def steps_per_epoch(self) -> int:
        return self.data.steps_per_epoch

    def step(self, index: int) -> loop.StepResult:
        rt = self.runtime
        micro_batches, global_targets = self.data.next_step()
        rt.zero_grad()
        outs = rt.forward_backward(micro_batches, sft_loss(global_targets))
        grad_norm, skipped = rt.optimizer_step()
        lr = rt.lr  # the lr this step used
        rt.lr_scheduler_step()
        # nothing here reads the device: the step's tokens come from the data plan, and the loss is summed
        # over the ranks on the device, so the loop can queue the next step before this one ends
        tokens = self.data.step_tokens
        loss = rt.global_sum(sum(o["loss"] for o in outs))
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped_steps": rt.skipped_steps,
                   "tokens": tokens, "target_tokens": int(global_targets), "epoch": self.data.epoch}
        return loop.StepResult(metrics, tokens, ("loss", loss), skipped=skipped)

    def evaluate(self) -> dict[str, float]:
        """Mean token NLL over the validation set (forward only); {} without one."""
        rt, nll, targets = self.runtime, 0.0, 0
        rt.eval()
        for micro_batches, _ in self.data.validation_steps():
            for out in rt.forward_backward(micro_batches, None, forward_only=True):
                nll -= float(out["logprobs"].sum())
            targets += sum(b.num_target_tokens for b in micro_batches)
        rt.train()
        nll, targets = rt.global_sum(nll), rt.global_sum(targets)
        return {"val_loss": nll / targets} if targets else {}

    def state_dict(self) -> dict:
        return {"data": self.data.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.data.load_state_dict(state["data"])

    def summary_lines(self, result: loop.RunResult) -> list[str]:
        lines = []
        records = [r for r in read_metrics(result.metrics_path) if "loss" in r]
        if records:
            first, last = records[0], records[-1]
            lines.append(f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
                         f"(step {last['step']})")
        evals = [r for r in read_metrics(result.metrics_path) if "val_loss" in r]
        if evals:
            lines.append(f"held-out loss {evals[-1]['val_loss']:.4f} (step {evals[-1]['step']})")
        return lines


def train_sft(job: JobConfig, console=None, show_progress: bool = True) -> SFTResult:
    """Train (or continue training) the job; returns where everything went."""
    if job.job != "sft":
        raise MliteError(f"this job is '{job.job}'; run it with `mlite {job.job}`")
    check_output_dir(job.trainer.output_dir)
    with Watchdog.for_job(job) as watch, RunLock(job.trainer.output_dir) as lock:
        watch.beat("start-up: the runtime (process group, model, weights)")
        runtime = Runtime(job, on_placed=lock.acquire)
        try:
            watch.beat("start-up: the data")
            trainer = SFTTrainer(job, runtime)
        except BaseException:
            runtime.close(clean=False)
            raise
        if first_rank() and console is not None:
            console.print(trainer.data.summary(), highlight=False)
        result = loop.run(job, runtime, trainer, console, show_progress, watch)
    return SFTResult(**vars(result), data_report=trainer.data.report)
