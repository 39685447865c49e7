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


def test_tiny_case_runs_both_sides_and_reports(tmp_path):
    from mlite.bench import CASES, render_table, run_case, write_results

    results = run_case(CASES["tiny-cpu"], "cpu", steps=2, warmup=1, compile_blocks=False)
    assert [r.side for r in results] == ["mlite", "hf"]
    for r in results:
        assert r.tokens_per_step == 128 and r.step_ms > 0 and r.tokens_per_s > 0 and 0 < r.mfu
    assert results[0].estimate_gb is None  # the planner estimates GPU memory; a CPU run has no peak to compare
    write_results(results, tmp_path / "r.json", {"device": "cpu"})
    assert '"side": "hf"' in (tmp_path / "r.json").read_text()
    assert render_table(results).row_count == 2


def test_cli_refuses_unknown_case_in_one_line():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mlite", "bench", "no-such-case"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown bench case" in proc.stderr


def test_multi_rank_cases_run_under_torchrun_on_gloo(tmp_path):
    """The multi-GPU cases' code (fsdp2 over dp, experts over ep, the N x one-GPU reference) on 2 gloo ranks."""
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
