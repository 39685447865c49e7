"""The benchmark's own arithmetic and code paths (the GPU figures live in docs/PERFORMANCE.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlite.bench import effective_seq_len, flops_per_token, mfu, mixed_lengths
from mlite.config.catalog import preset_arch


def test_mfu_formula_reproduces_the_reference_baselines():
    # ../shared/REFERENCE.md section 4: HF transformers on one H100, sequence 4096
    dense = preset_arch("qwen3-1.7b")
    assert mfu(dense, [4096], tokens_per_s=21_816, peak_tflops=989) == pytest.approx(0.259, abs=0.001)
    moe = replace(preset_arch("qwen3-30b-a3b"), num_layers=6)
    assert mfu(moe, [4096], tokens_per_s=33_556, peak_tflops=989) == pytest.approx(0.153, abs=0.001)


def test_attention_flops_follow_the_packed_lengths():
    arch = preset_arch("qwen3-1.7b")
    one_long = flops_per_token(arch, [4096])
    four_short = flops_per_token(arch, [1024] * 4)
    # same tokens, a quarter of the causal attention work per token
    attention_long = 6 * arch.num_layers * arch.num_heads * arch.head_dim * 4096
    assert one_long - four_short == pytest.approx(attention_long * 3 / 4)
    assert effective_seq_len([1024] * 4) == 1024


def test_mixed_lengths_fill_the_budget_exactly_and_vary():
    lens = mixed_lengths(4096, seed=3)
    assert sum(lens) == 4096 and len(set(lens)) > 1
    assert lens == mixed_lengths(4096, seed=3)


def test_flops_per_token_counts_every_matmul_a_token_passes_through():
    # tiny-qwen3 by hand: hidden 64, 4 query / 2 KV heads of 16, FFN 128, vocab 256, 2 layers
    arch = preset_arch("tiny-qwen3")
    attention = 64 * 64 + 2 * (64 * 32) + 64 * 64  # q, k, v, o
    mlp = 3 * 64 * 128  # gate, up, down
    head = 64 * 256  # counted although tied to the embedding
    matmuls = 2 * (attention + mlp) + head
    lens = [40, 24]
    by_hand = 6 * matmuls + 6 * 2 * 4 * 16 * (40 * 40 + 24 * 24) / 64
    assert flops_per_token(arch, lens) == pytest.approx(by_hand, rel=5e-3)  # norm weights ride along


def test_tiny_case_runs_the_runtime_and_hf_and_reports_sane_figures(tmp_path):
    import math
    import statistics

    from mlite.bench import CASES, case_arch, render_table, run_case, write_results

    case = CASES["tiny-cpu"]
    results = run_case(case, "cpu", steps=2, warmup=1, peak_tflops=0.5)
    assert [r.side for r in results] == ["mlite", "hf"]
    arch = case_arch(case)
    for r in results:
        seq_lens = r.extra["seq_lens"]
        assert r.tokens_per_step == sum(seq_lens) == 128 and len(seq_lens) > 1  # a packed batch of several
        assert r.step_ms == statistics.median(r.extra["step_ms_all"]) > 0 and len(r.extra["step_ms_all"]) == 2
        assert r.tokens_per_s == pytest.approx(128 / (r.step_ms / 1e3))
        assert r.flops_per_token == pytest.approx(flops_per_token(arch, seq_lens))
        assert r.mfu == pytest.approx(r.flops_per_token * r.tokens_per_s / 0.5e12) and r.mfu > 0
    mlite_side = results[0]
    # the trainer's figures from the Runtime: random weights predict about uniformly over the 256 tokens
    assert abs(mlite_side.extra["loss"] - math.log(arch.vocab)) < 0.5
    assert 0 < mlite_side.extra["grad_norm"] < math.inf
    assert mlite_side.estimate_gb is None  # the planner estimates GPU memory; a CPU run has no peak
    write_results(results, tmp_path / "r.json", {"device": "cpu"})
    assert '"side": "hf"' in (tmp_path / "r.json").read_text()
    assert render_table(results).row_count == 2


def test_bench_drives_the_runtime_as_the_sft_trainer_does(monkeypatch):
    """No step of its own: each timed step is zero_grad, forward_backward over the case's micro-batches,
    optimizer_step, lr_scheduler_step on mlite.runtime.engine.Runtime, in the SFT trainer's order."""
    from mlite.bench import CASES, run_case
    from mlite.runtime.engine import Runtime

    calls = []
    for name in ("zero_grad", "forward_backward", "optimizer_step", "lr_scheduler_step"):
        method = getattr(Runtime, name)

        def spy(self, *args, _method=method, _name=name, **kwargs):
            calls.append((_name, len(args[0]) if args else None))
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(Runtime, name, spy)
    case = replace(CASES["tiny-cpu"], accum=2, baseline=False)
    (result,) = run_case(case, "cpu", steps=2, warmup=1)
    step = [("zero_grad", None), ("forward_backward", 2), ("optimizer_step", None),
            ("lr_scheduler_step", None)]
    assert calls == step * 3  # 1 warm-up + 2 timed steps, 2 micro-batches each
    assert result.tokens_per_step == 2 * 128 and result.extra["accum"] == 2


def test_cli_refuses_unknown_case_in_one_line():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mlite", "bench", "no-such-case"], capture_output=True,
                          text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown bench case" in proc.stderr


def test_multi_rank_cases_run_under_torchrun_on_gloo(tmp_path):
    """The multi-GPU cases' code (fsdp2 over dp, experts over ep, the N x one-GPU reference) on 2 gloo
    ranks."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "mlite", "bench",
         "tiny-cpu-dp2", "tiny-cpu-ep2", "--device", "cpu", "--steps", "2", "--warmup", "1", f"--out={out}"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["case"], r["side"]) for r in results] == [
        ("tiny-cpu-dp2", "mlite x2"), ("tiny-cpu-dp2", "2 x one GPU"),
        ("tiny-cpu-ep2", "mlite x2"), ("tiny-cpu-ep2", "2 x one GPU"),
    ]
    for parallel, single in zip(results[::2], results[1::2]):
        assert parallel["tokens_per_step"] == single["tokens_per_step"] == 2 * 128  # one replica per rank
        assert parallel["extra"]["scaling"] == parallel["tokens_per_s"] / single["tokens_per_s"] > 0
    assert "of 2 x one GPU" in proc.stdout


def test_multi_rank_case_without_torchrun_says_how_to_launch_it():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mlite", "bench", "dense-1.7b-4k-dp4"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "torchrun --nproc-per-node 4 -m mlite bench dense-1.7b-4k-dp4" in proc.stderr
