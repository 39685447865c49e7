"""precision.optimizer_state: fp8: AdamW's moments in e4m3 with power-of-two block scales, stochastically
rounded (mlite.runtime.kernels.adamw). The encoding is exact to undo and unbiased; the optimizer tracks
AdamW and its moments keep decaying where round-to-nearest would freeze them; its state_dict is AdamW's and
resumes bitwise, also under FSDP2, TP and EP shards and across layouts (test_parallel_resume.py); the
planner sizes it; the rule book refuses it where it does not run. On a GPU the Triton kernel equals the
pure-torch reference (rounding half up) and its stochastic rounding is unbiased."""

from __future__ import annotations

import copy

import pytest
import torch

from mlite.config import job_from_dict
from mlite.errors import MliteError
from mlite.runtime.kernels import adamw as kernel
from mlite.runtime.kernels.adamw import (
    FP8_BLOCK,
    Fp8StateAdamW,
    fp8_decode,
    fp8_encode,
    fp8_noise,
)

BETAS, EPS = (0.9, 0.95), 1e-8


def _values(n: int, seed: int = 0) -> torch.Tensor:
    """Signed values spanning 10 decades, so blocks hold both large and tiny entries."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.logspace(-7, 3, n)[torch.randperm(n, generator=gen)]


# ------------------------------------------------------------------------------------------ encoding
def test_encoding_is_within_half_an_e4m3_step_and_decodes_back_exactly():
    x = _values(10_000)
    q, scale = fp8_encode(x, 0.5)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (-(-x.numel() // FP8_BLOCK),)
    # every scale a power of two, and each block's largest magnitude lands in e4m3's top binade
    assert torch.equal(torch.frexp(scale).mantissa, torch.full_like(scale, 0.5))
    tail = scale.numel() * FP8_BLOCK - x.numel()
    blocks = torch.nn.functional.pad(q.float(), (0, tail)).view(-1, FP8_BLOCK)
    assert ((blocks.abs().amax(1) >= 224) & (blocks.abs().amax(1) <= 448)).all()
    decoded = fp8_decode(q, scale)
    # within half a step of e4m3's 3-bit mantissa (1/16 relative) wherever x is in the normal range
    padded = torch.nn.functional.pad(x.abs(), (0, tail))
    block_max = padded.view(-1, FP8_BLOCK).amax(1).repeat_interleave(FP8_BLOCK)[: x.numel()]
    in_range = x.abs() > block_max * 2**-13  # above e4m3's subnormals (2**-6 of 448 * 2**-8 at worst)
    rel = ((decoded - x).abs() / x.abs())[in_range]
    assert rel.max() <= 1 / 16 + 1e-7 and in_range.float().mean() > 0.3
    assert (decoded.sign() * x.sign() >= 0).all()
    again = fp8_encode(decoded, 0.5)  # decoded values encode to themselves: a checkpoint round trip
    assert torch.equal(fp8_decode(*again), decoded)


def test_stochastic_rounding_is_unbiased_between_the_two_neighbours():
    x = torch.full((400_000,), 0.3)
    q, scale = fp8_encode(x, fp8_noise(x, seed=0, step=1, index=0))
    decoded = fp8_decode(q, scale)
    assert set(decoded.unique().tolist()) == {0.28125, 0.3125}  # e4m3 at 0.3: 0.28125 and 0.3125
    assert decoded.mean().item() == pytest.approx(0.3, rel=2e-3)
    half_up = fp8_decode(*fp8_encode(x, 0.5))
    assert half_up.unique().tolist() == [0.3125]  # round half up alone is biased by 4%


def test_the_noise_is_a_function_of_seed_step_and_tensor_only():
    like = torch.empty(1000)
    assert torch.equal(fp8_noise(like, 3, 7, 2), fp8_noise(like, 3, 7, 2))
    assert not torch.equal(fp8_noise(like, 3, 7, 2), fp8_noise(like, 3, 8, 2))
    assert not torch.equal(fp8_noise(like, 3, 7, 2), fp8_noise(like, 3, 7, 3))
    assert not torch.equal(fp8_noise(like, 3, 7, 2), fp8_noise(like, 4, 7, 2))


# ------------------------------------------------------------------------------------------ optimizer
def _regression(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, w_true = torch.randn(512, 48, generator=gen), torch.randn(48, 6, generator=gen)
    y = x @ w_true + 0.01 * torch.randn(512, 6, generator=gen)
    return x, y


def _train(opt, w, x, y, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_fp8_state_adamw_tracks_adamw_on_a_regression():
    x, y = _regression()
    w_fp8 = torch.nn.Parameter(torch.zeros(48, 6))
    w_ref = torch.nn.Parameter(torch.zeros(48, 6))
    fp8 = Fp8StateAdamW([w_fp8], lr=3e-2, betas=BETAS, eps=EPS, weight_decay=0.01, fused=True)
    ref = torch.optim.AdamW([w_ref], lr=3e-2, betas=BETAS, eps=EPS, weight_decay=0.01)
    losses_fp8, losses_ref = _train(fp8, w_fp8, x, y, 300), _train(ref, w_ref, x, y, 300)
    assert losses_fp8[0] == losses_ref[0]
    # the same path down to the noise floor (within 25% at every 25th step until then), and both solve it
    for step in range(0, 125, 25):
        assert losses_fp8[step] == pytest.approx(losses_ref[step], rel=0.25), step
    assert losses_fp8[-1] < 1e-3 * losses_fp8[0] and losses_fp8[-1] < 2 * losses_ref[-1]
    assert (w_fp8 - w_ref).norm() / w_ref.norm() < 0.02
    # the state is e4m3 with block scales: a quarter of fp32's bytes, plus the scales
    state = fp8.state[w_fp8]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float8_e4m3fn
    assert state["exp_avg_scale"].numel() == -(-w_fp8.numel() // FP8_BLOCK)


def test_stochastic_rounding_lets_the_second_moment_decay_where_rounding_to_nearest_freezes_it():
    """After gradients stop, v decays by beta2 each step in AdamW (5% at 0.95): below half an e4m3 step,
    so rounding to nearest leaves it where it was; stochastic rounding follows AdamW on average."""
    def decayed(stochastic: bool) -> float:
        w = torch.nn.Parameter(torch.zeros(4096))
        opt = Fp8StateAdamW([w], lr=1e-3, betas=BETAS, eps=EPS, fused=True)
        opt.stochastic = stochastic
        w.grad = torch.full_like(w, 1.0)
        opt.step()
        start = opt.state_dict()["state"][0]["exp_avg_sq"].mean().item()
        for _ in range(20):
            w.grad = torch.zeros_like(w)
            opt.step()
        return opt.state_dict()["state"][0]["exp_avg_sq"].mean().item() / start

    assert decayed(True) == pytest.approx(0.95**20, rel=0.05)
    assert decayed(False) > 0.6  # frozen for most of the way (AdamW: 0.36)


def test_state_dict_is_adamws_and_a_reload_continues_bitwise():
    x, y = _regression(1)
    w = torch.nn.Parameter(torch.zeros(48, 6))
    bias = torch.nn.Parameter(torch.zeros(6))
    opt = Fp8StateAdamW([{"params": [w], "weight_decay": 0.1}, {"params": [bias], "weight_decay": 0.0}],
                        lr=1e-2, betas=BETAS, eps=EPS, fused=True, seed=5)

    def run(opt, w, bias, steps):
        for _ in range(steps):
            opt.zero_grad()
            ((x @ w + bias - y) ** 2).mean().backward()
            opt.step()

    run(opt, w, bias, 5)
    saved = copy.deepcopy(opt.state_dict())
    ref = torch.optim.AdamW([w], lr=1e-2)
    ((x @ w - y) ** 2).mean().backward()
    ref.step()
    ref_state = ref.state_dict()["state"][0]
    assert set(saved["state"][0]) == set(ref_state)
    assert {k: (v.dtype, v.shape) for k, v in saved["state"][0].items()} == \
        {k: (v.dtype, v.shape) for k, v in ref_state.items()}
    assert saved["state"][0]["step"].item() == 5

    w2, bias2 = torch.nn.Parameter(w.detach().clone()), torch.nn.Parameter(bias.detach().clone())
    resumed = Fp8StateAdamW([{"params": [w2], "weight_decay": 0.1}, {"params": [bias2], "weight_decay": 0.0}],
                            lr=1e-2, betas=BETAS, eps=EPS, fused=True, seed=5)
    resumed.load_state_dict(saved)
    assert resumed.state[w2]["exp_avg"].dtype == torch.float8_e4m3fn
    assert torch.equal(fp8_decode(resumed.state[w2]["exp_avg_sq"], resumed.state[w2]["exp_avg_sq_scale"]),
                       fp8_decode(opt.state[w]["exp_avg_sq"], opt.state[w]["exp_avg_sq_scale"]))
    w.grad = bias.grad = None
    run(opt, w, bias, 5)
    run(resumed, w2, bias2, 5)
    assert torch.equal(w, w2) and torch.equal(bias, bias2)


def test_an_adamw_checkpoint_loads_into_fp8_state():
    w = torch.nn.Parameter(torch.randn(300))
    w.grad = torch.randn(300)
    ref = torch.optim.AdamW([w], lr=1e-3)
    ref.step()
    opt = Fp8StateAdamW([torch.nn.Parameter(w.detach().clone())], lr=1e-3, fused=True)
    opt.load_state_dict(ref.state_dict())
    state = next(iter(opt.state.values()))
    m = fp8_decode(state["exp_avg"], state["exp_avg_scale"])
    assert torch.allclose(m, ref.state[w]["exp_avg"], rtol=1 / 16, atol=0)


# ----------------------------------------------------------------------------------- rules and plan
def _job(**precision):
    return job_from_dict({"job": "sft", "model": {"name": "tiny-qwen3"},
                          "cluster": {"gpu": "cpu", "gpus_per_node": 1},
                          "precision": {"compute": "fp32", **precision},
                          "trainer": {"device": "cpu"}})


def test_the_rule_book_takes_fp8_state_on_fsdp2_layouts_and_refuses_it_elsewhere():
    from mlite.plan.rules import check_backend, check_precision

    check_precision(_job(optimizer_state="fp8"), 1, "cpu")  # one process
    check_precision(_job(optimizer_state="fp8"), 4, "cpu")  # FSDP2 shards
    gpu = job_from_dict({"job": "sft", "model": {"name": "tiny-qwen3"},
                         "precision": {"optimizer_state": "fp8"},
                         "offload": {"optimizer": True, "optimizer_fraction": 0.5}})
    with pytest.raises(MliteError, match=r"fp8 keeps the Adam state on the GPU, and offload.optimizer moves"):
        check_precision(gpu, 2, "cuda")
    job = job_from_dict({"job": "sft", "model": {"name": "tiny-qwen3"}, "optimizer": {"backend": "dist_opt"},
                         "precision": {"optimizer_state": "fp8"}})
    with pytest.raises(MliteError, match="optimizer_state fp8 is not supported by optimizer.backend"):
        check_backend(job)


def test_the_planner_sizes_fp8_state_at_a_quarter_of_fp32():
    from mlite.plan import plan_job

    sizes = {}
    for state in ("master", "fp8"):
        job = job_from_dict({"job": "sft", "model": {"name": "qwen3-8b"},
                             "cluster": {"gpus_per_node": 1},
                             "precision": {"optimizer_state": state}})
        items = {i.name: i.gb for i in plan_job(job).memory.items}
        sizes[state] = items["optimizer state"]
    assert sizes["fp8"] == pytest.approx(sizes["master"] / 4 * (1 + 4 / 128), rel=1e-6)


def test_runtime_builds_fp8_state_for_the_job_key(tmp_path):
    from mlite.runtime.engine import Runtime

    job = job_from_dict({"job": "sft", "model": {"name": "tiny-qwen3"},
                         "cluster": {"gpu": "cpu", "gpus_per_node": 1},
                         "precision": {"compute": "fp32", "optimizer_state": "fp8"},
                         "data": {"seq_len": 128},
                         "trainer": {"device": "cpu", "seed": 9, "output_dir": str(tmp_path)}})
    rt = Runtime(job)
    assert isinstance(rt.optim.optimizer, Fp8StateAdamW) and rt.optim.optimizer.seed == 9


# ----------------------------------------------------------------------------------------------- GPU
def _gpu_params(dtype, sizes, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, device="cuda").to(dtype)) for s in sizes]


# big enough for several programs of 65536 elements, with ragged tails and blocks cut short
GPU_SIZES = [(7,), (129,), (300, 5), (513, 257), (70_001,), (200_003,)]
UNUSED_ROWS_SHAPE, UNUSED_ROWS = (513, 257), 300  # gradient rows kept at zero: the kernel's zero-moment path


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_equals_the_torch_reference(dtype):
    kernel_params = _gpu_params(dtype, GPU_SIZES)
    reference_params = [torch.nn.Parameter(p.detach().clone()) for p in kernel_params]
    groups = lambda ps: [{"params": ps[2:], "weight_decay": 0.1}, {"params": ps[:2], "weight_decay": 0.0}]  # noqa: E731
    ours = Fp8StateAdamW(groups(kernel_params), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
    reference = Fp8StateAdamW(groups(reference_params), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
    ours.stochastic = reference.stochastic = False  # round half up in both: comparable bit by bit
    reference._plan = lambda: None  # the pure-torch step, on the same GPU tensors
    ulp = {torch.bfloat16: 2**-7, torch.float32: 2**-22}[dtype]
    for step in range(4):
        if step:  # each step from the same state: the kernel's one-step map against the reference's
            with torch.no_grad():
                for a, b in zip(kernel_params, reference_params):
                    b.copy_(a)
                    reference.state[b].update({k: v.clone() for k, v in ours.state[a].items()})
        gen = torch.Generator(device="cuda").manual_seed(step)
        for a, b in zip(kernel_params, reference_params):
            g = (torch.randn(a.shape, generator=gen, device="cuda") * 10.0 ** -(step % 3)).to(dtype)
            if a.shape == UNUSED_ROWS_SHAPE:  # an embedding's rows that no token used: zero moments
                g[:UNUSED_ROWS] = 0
            a.grad, b.grad = g, g.clone()
        coef = torch.tensor(0.5, device="cuda") if step == 2 else None
        ours.step(grad_coef=coef)
        reference.step(grad_coef=coef)
        assert ours._tables, "the fp8 step fell back to torch"
        for a, b in zip(kernel_params, reference_params):
            torch.testing.assert_close(a.float(), b.float(), rtol=2 * ulp, atol=1e-7)
            for moment in ("exp_avg", "exp_avg_sq"):
                mine = fp8_decode(ours.state[a][moment], ours.state[a][f"{moment}_scale"])
                theirs = fp8_decode(reference.state[b][moment], reference.state[b][f"{moment}_scale"])
                # fp32 roundings differ (the kernel's fmas, (1 - beta1) as g - beta1 g): on values at an
                # e4m3 midpoint, common with bf16 gradients, round half up may land one e4m3 step apart
                differ = (mine != theirs).float().mean().item()
                assert differ < 0.05, (step, moment, differ)
                # a block whose largest value rounded apart may take the other power of two as its scale
                scale = torch.maximum(ours.state[a][f"{moment}_scale"], reference.state[b][f"{moment}_scale"])
                scale = scale.repeat_interleave(FP8_BLOCK)[: a.numel()].view(a.shape)
                one_step = torch.maximum(mine.abs(), theirs.abs()) / 8 + scale * 2**-9
                assert ((mine - theirs).abs() <= one_step).all(), (step, moment)
    (unused,) = [p for p in kernel_params if p.shape == UNUSED_ROWS_SHAPE]
    assert not ours.state[unused]["exp_avg"][:UNUSED_ROWS].float().any()
    assert not ours.state[unused]["exp_avg_sq"][:UNUSED_ROWS].float().any()
    # a non-finite norm skips the step on the device: nothing moves
    before = [p.detach().clone() for p in kernel_params]
    ours.step(found_inf=torch.tensor(1.0, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(kernel_params, before))


@pytest.mark.gpu
def test_the_kernels_stochastic_rounding_is_unbiased_and_seeded():
    def first_moment(seed):
        (p,) = _gpu_params(torch.float32, [(1 << 20,)])
        p.grad = torch.full_like(p, 0.3 / (1 - BETAS[0]))  # m after one step: 0.3 exactly
        opt = Fp8StateAdamW([p], lr=1e-3, betas=BETAS, eps=EPS, fused=True, seed=seed)
        opt.step()
        assert opt._tables
        return fp8_decode(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_scale"])

    m = first_moment(0)
    assert set(m.unique().tolist()) == {0.28125, 0.3125}
    assert m.mean().item() == pytest.approx(0.3, rel=1e-3)
    assert torch.equal(m, first_moment(0)) and not torch.equal(m, first_moment(1))


@pytest.mark.gpu
def test_local_adamw_on_one_gpu_steps_fp8_state_through_the_kernel_without_a_host_sync():
    from mlite.config.schema import OptimizerConfig
    from mlite.runtime.optim import LocalAdamW

    params = _gpu_params(torch.bfloat16, GPU_SIZES)
    opt = LocalAdamW(params, OptimizerConfig(weight_decay=0.1, clip_grad=1.0), state="fp8", seed=3)
    assert isinstance(opt.optimizer, Fp8StateAdamW)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # first step: tables built
    for p in params:
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm, skipped = opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert opt.optimizer._tables and norm.is_cuda and not bool(skipped)
    assert kernel._TL_DTYPES  # Triton present on the GPU machine
