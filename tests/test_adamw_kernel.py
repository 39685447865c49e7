"""TritonAdamW is torch.optim.AdamW: on the CPU it is torch's step itself; on a GPU its Triton kernel gives
torch's fused AdamW's update within rounding (on an H100: 2 of 14.8M bf16 elements 1 ulp apart, fp32 within
1.1e-6 relative; the assertion allows 1 bf16 ulp, 16 fp32 ulps), and checkpoints move between the two either
way."""

from __future__ import annotations

import copy

import pytest
import torch

from mlite.runtime.kernels import adamw as kernel
from mlite.runtime.kernels.adamw import TritonAdamW

BETAS, EPS = (0.9, 0.95), 1e-8


def _params(dtype, device, sizes):
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, device=device).to(dtype)) for s in sizes]


def _groups(params):
    # LocalAdamW's split: weight decay on matrices only, so both the decay and the no-decay kernel run
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def _set_grads(step, *param_lists):
    """The same gradients, of mixed scales, on every list (independent of the parameters' values)."""
    for params in zip(*param_lists):
        gen = torch.Generator(device=params[0].device).manual_seed(1000 * step + params[0].numel())
        scale = 10.0 ** -(step % 4)
        g = torch.randn(params[0].shape, generator=gen, device=params[0].device) * scale
        for p in params:
            p.grad = g.to(p.dtype)


def _run(opts_and_params, steps):
    for step in steps:
        _set_grads(step, *[params for _, params in opts_and_params])
        for opt, _ in opts_and_params:
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (1 + step) / 4  # as LRSchedule: a new lr in param_groups every step
            opt.step()


def _tensors(opt, params):
    """Each parameter with its exp_avg, exp_avg_sq and step, in order."""
    return [t for p in params for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"],
                                        opt.state[p]["step"])]


def _ulps(a, b):
    """Distance in units in the last place between same-dtype floating tensors (0 where bitwise equal)."""
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]

    def ordered(t):  # sign-magnitude bits -> integers in the floats' order (-0 and +0 both 0)
        i = t.detach().view(ints).long()
        return torch.where(i < 0, -(i & torch.iinfo(ints).max), i)

    return (ordered(a) - ordered(b)).abs()


# --------------------------------------------------------------------------------------------- CPU
CPU_SIZES = [(), (1,), (5,), (3, 7), (64, 33)]


@pytest.mark.skipif(kernel._INTERPRET, reason="under TRITON_INTERPRET=1 the kernel serves CPU tensors")
@pytest.mark.parametrize("options", [{}, {"fused": True}, {"foreach": True}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cpu_it_is_torch_adamw(dtype, options):
    ours, theirs = _params(dtype, "cpu", CPU_SIZES), _params(dtype, "cpu", CPU_SIZES)
    opt_ours = TritonAdamW(_groups(ours), lr=1e-3, betas=BETAS, eps=EPS, **options)
    opt_theirs = torch.optim.AdamW(_groups(theirs), lr=1e-3, betas=BETAS, eps=EPS, **options)
    _run([(opt_ours, ours), (opt_theirs, theirs)], range(3))
    for a, b in zip(_tensors(opt_ours, ours), _tensors(opt_theirs, theirs)):
        assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    sd_ours, sd_theirs = opt_ours.state_dict(), opt_theirs.state_dict()
    assert sd_ours["param_groups"] == sd_theirs["param_groups"]
    assert sd_ours["state"].keys() == sd_theirs["state"].keys()
    assert all(sd_ours["state"][i].keys() == sd_theirs["state"][i].keys() for i in sd_ours["state"])


def test_the_tile_follows_the_gpu_where_one_was_measured_faster():
    """An H200 streams with 4096-element tiles of 16 warps (measured faster there); other GPUs, and the fp8
    kernel (swept on an H100 only), keep the class tile."""
    assert TritonAdamW.tile_for("NVIDIA H200") == (4096, 16)
    h100 = TritonAdamW.tile_for("NVIDIA H100 80GB HBM3")
    assert h100 == (TritonAdamW.block, TritonAdamW.num_warps) == (2048, 8)
    assert kernel.Fp8StateAdamW.tile_for("NVIDIA H200") == (1024, 4)
    for block, warps in TritonAdamW.tiles_by_gpu.values():
        assert block == warps * 32 * 8  # one 16-byte bf16 vector per thread


@pytest.mark.skipif(kernel._INTERPRET, reason="under TRITON_INTERPRET=1 the kernel serves CPU tensors")
@pytest.mark.parametrize("direction", ["ours->torch", "torch->ours"])
def test_on_cpu_a_checkpoint_of_one_loads_into_the_other(direction):
    for a, b in zip(*_checkpoint_roundtrip("cpu", torch.float32, CPU_SIZES, direction)):
        assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


@pytest.mark.skipif(kernel._INTERPRET, reason="under TRITON_INTERPRET=1 the kernel serves CPU tensors")
def test_on_cpu_a_found_inf_flag_skips_the_step():
    _check_found_inf("cpu", torch.float32, CPU_SIZES)


def _check_found_inf(device, dtype, sizes):
    """step(found_inf=1) changes no parameter, moment or step count; step(found_inf=0) then equals a step
    of an optimizer that never saw the skipped one. The flag stays on the device (no host sync)."""
    ours, plain = _params(dtype, device, sizes), _params(dtype, device, sizes)
    opt_ours = TritonAdamW(_groups(ours), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
    opt_plain = TritonAdamW(_groups(plain), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
    _run([(opt_ours, ours), (opt_plain, plain)], range(2))
    before = [t.clone() for t in _tensors(opt_ours, ours)]
    _set_grads(2, ours)
    opt_ours.step(grad_coef=torch.tensor(0.5, device=device), found_inf=torch.ones((), device=device))
    assert all(torch.equal(a, b) for a, b in zip(_tensors(opt_ours, ours), before)), "a skipped step wrote"
    _set_grads(3, ours, plain)
    for p in plain:  # _set_grads shares one fp32 tensor between the lists, and torch's step scales it
        p.grad = p.grad.clone()
    coef = torch.tensor(0.25, device=device)
    opt_ours.step(grad_coef=coef, found_inf=torch.zeros((), device=device))
    opt_plain.step(grad_coef=coef)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(opt_ours, ours), _tensors(opt_plain, plain)))
    assert not torch.equal(_tensors(opt_ours, ours)[1], before[1])  # it did step (a bf16 parameter may
    # not move at this lr, its first moment does)
    return opt_ours


def _checkpoint_roundtrip(device, dtype, sizes, direction):
    """Two steps with one optimizer; its state_dict into a fresh one of the other kind over a copy of the
    parameters; three more steps on both. Returns both tensor lists (see _tensors), which should agree."""
    first_cls, second_cls = (TritonAdamW, torch.optim.AdamW) if direction == "ours->torch" else \
        (torch.optim.AdamW, TritonAdamW)
    params = _params(dtype, device, sizes)
    first = first_cls(_groups(params), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
    _run([(first, params)], range(2))
    moved = [torch.nn.Parameter(p.detach().clone()) for p in params]
    second = second_cls(_groups(moved), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    _run([(first, params), (second, moved)], range(2, 5))
    return _tensors(first, params), _tensors(second, moved)


# --------------------------------------------------------------------------------------------- GPU
GPU_SIZES = [(), (1,), (7,), (2048,), (3, 5), (1000, 333), (2048, 2049), (2, 3 * 65536 + 17)]


def _gpu_params(dtype):
    return _params(dtype, "cuda", GPU_SIZES)


def _compare(label, ours, theirs):
    """Prints how far apart the two lists are (bitwise, in ulps); asserts closeness within rounding."""
    total = differ = worst = 0
    rel = absolute = 0.0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
        ulps = _ulps(a, b)
        total, differ, worst = total + a.numel(), differ + int((ulps > 0).sum()), max(worst, int(ulps.max()))
        d = (a.float() - b.float()).abs()
        absolute = max(absolute, float(d.max()))
        rel = max(rel, float((d / b.float().abs().clamp(min=1e-3)).max()))
        if int(ulps.max()) > 1:
            print(f"  tensor {i} {list(a.shape)}: {int((ulps > 0).sum())} differ, max {int(ulps.max())} ulp, "
                  f"max abs {float(d.max()):.3g}")
    print(f"\n{label}: {differ} of {total} elements differ from torch's fused AdamW (max {worst} ulp, "
          f"max abs {absolute:.3g}, max rel {rel:.3g})")
    for a, b in zip(ours, theirs):
        # not bitwise (Triton's code generation is not nvcc's): within 1 bf16 ulp, or 16 fp32 ulps, of each
        # tensor's values (a rounding difference, far inside the CPU parity tolerance)
        eps = torch.finfo(a.dtype).eps * (1 if a.dtype == torch.bfloat16 else 16)
        scale = max(float(b.float().abs().max()), 1e-3)
        torch.testing.assert_close(a.float(), b.float(), rtol=eps, atol=eps * 1e-2 * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_kernel_matches_torch_fused(dtype):
    ours, theirs = _gpu_params(dtype), _gpu_params(dtype)
    opt_ours = TritonAdamW(_groups(ours), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
    # this GPU's tile (an H200's differs from the class default)
    assert (opt_ours.block, opt_ours.num_warps) == TritonAdamW.tile_for(torch.cuda.get_device_name())
    opt_theirs = torch.optim.AdamW(_groups(theirs), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
    _run([(opt_ours, ours), (opt_theirs, theirs)], range(5))
    assert opt_ours._tables, "TritonAdamW fell back to torch's step"
    # fresh gradients every step (new addresses) rewrote the gradient column, not the whole table
    assert len(opt_ours._tables) == len(opt_ours.param_groups)
    launches = [launch for launches, _ in opt_ours._tables.values() for launch in launches]
    assert launches and all(aligned for _, _, aligned, *_ in launches)
    _compare(f"{dtype} after 5 steps", _tensors(opt_ours, ours), _tensors(opt_theirs, theirs))
    for p in ours:  # the state torch's fused AdamW keeps
        assert opt_ours.state[p]["step"].dtype == torch.float32 and opt_ours.state[p]["step"].is_cuda


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["ours->torch", "torch->ours"])
def test_gpu_checkpoints_are_interchangeable(direction):
    _compare(f"checkpoint {direction}, 3 steps on", *_checkpoint_roundtrip("cuda", torch.bfloat16, GPU_SIZES,
                                                                           direction))


@pytest.mark.gpu
def test_local_adamw_takes_the_kernel_on_one_gpu():
    from mlite.config.schema import OptimizerConfig
    from mlite.runtime.optim import LocalAdamW

    params = _params(torch.bfloat16, "cuda", [(64, 64), (64,)])
    opt = LocalAdamW(params, OptimizerConfig(weight_decay=0.1))
    assert isinstance(opt.optimizer, TritonAdamW)
    _set_grads(0, params)
    norm, skipped = opt.step()
    assert not skipped and opt.optimizer._tables


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_a_found_inf_flag_skips_the_kernels_step(dtype):
    opt = _check_found_inf("cuda", dtype, GPU_SIZES)
    assert opt._plan() is not None  # the kernel served the steps


@pytest.mark.gpu
def test_gpu_local_adamw_steps_and_skips_without_a_host_sync():
    """On one GPU LocalAdamW's norm, non-finite check, clipping and update are all queued: the step runs
    under CUDA's sync debug mode set to raise; a NaN gradient skips the update on the device."""
    from mlite.config.schema import OptimizerConfig
    from mlite.runtime.optim import LocalAdamW

    params = _params(torch.bfloat16, "cuda", [(64, 64), (64,)])
    opt = LocalAdamW(params, OptimizerConfig(weight_decay=0.1, clip_grad=1.0))
    _set_grads(0, params)
    opt.step()  # the first step builds the kernel's tables and state
    before = [p.detach().clone() for p in params]
    for step, poison in ((1, True), (2, False)):
        _set_grads(step, params)
        if poison:
            params[0].grad[0, 0] = float("nan")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            norm, skipped = opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert bool(skipped) == poison and torch.isnan(norm).item() == poison
        if poison:
            assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert int(opt.skipped_steps) == 1 and not torch.equal(params[0], before[0])


@pytest.mark.gpu
def test_gpu_a_view_off_alignment_takes_torchs_step():
    """A parameter that is a view 2 bytes into its storage cannot load 16-byte vectors: the whole step is
    torch's fused one (the kernel once got such a tensor wrong)."""
    params = _gpu_params(torch.bfloat16)
    params.append(torch.nn.Parameter(torch.randn(4097, device="cuda").to(torch.bfloat16)[1:]))
    opt = TritonAdamW(_groups(params), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    assert opt._plan() is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("aligned", [True, False])
def test_gpu_clipping_inside_the_step_equals_clipping_first(dtype, aligned):
    """step(grad_coef=c) gives the update of torch's fused AdamW on gradients first scaled by c with
    _foreach_mul_ (what clipping did before the step), whether the kernel serves the step (it scales each
    gradient as it reads it) or a misaligned view sends it to torch's step (which scales them first)."""
    ours, theirs = _gpu_params(dtype), _gpu_params(dtype)
    if not aligned:  # the same values in both lists, as a view 2 or 4 bytes into its storage
        base = torch.randn(4097, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
        for params in (ours, theirs):
            params.append(torch.nn.Parameter(base.to(dtype, copy=True)[1:]))
    opt_ours = TritonAdamW(_groups(ours), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
    opt_theirs = torch.optim.AdamW(_groups(theirs), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
    for step in range(4):
        _set_grads(step, ours, theirs)
        coef = torch.tensor(0.37 + 0.2 * step, device="cuda").clamp(max=1.0)  # 1.0 on the last step
        for p in theirs:  # _set_grads shares one fp32 tensor between the lists
            p.grad = p.grad.clone()
        torch._foreach_mul_([p.grad for p in theirs], coef)
        for opt in (opt_ours, opt_theirs):
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (1 + step) / 4
        opt_ours.step(grad_coef=coef)
        opt_theirs.step()
    assert (opt_ours._plan() is not None) == aligned  # the kernel served the step, or torch's did
    _compare(f"{dtype} clipped inside the step ({'kernel' if aligned else 'torch'})",
             _tensors(opt_ours, ours), _tensors(opt_theirs, theirs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_grad_norm_over_the_steps_tables_equals_the_fp64_norm(dtype):
    """TritonAdamW.grad_norm sums the squares of every gradient in fp32 over the step's own tables (chunks
    of big tensors, 0-dim and odd sizes, both groups): the fp64 norm of the same values within fp32
    rounding. A NaN gradient gives NaN; LocalAdamW's norm on one GPU is this one."""
    from mlite.config.schema import OptimizerConfig
    from mlite.runtime.optim import LocalAdamW

    params = _gpu_params(dtype)
    opt = TritonAdamW(_groups(params), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
    for step in (0, 3):  # gradients of scale 1, then 1e-3
        _set_grads(step, params)
        norm = opt.grad_norm()
        exact = torch.cat([p.grad.double().flatten() for p in params]).norm()
        assert norm.dtype == torch.float32 and norm.is_cuda and norm.dim() == 0
        torch.testing.assert_close(norm.double(), exact, rtol=1e-5, atol=0)
    params[5].grad[7, 11] = float("nan")
    assert torch.isnan(opt.grad_norm())

    local = LocalAdamW(_gpu_params(dtype), OptimizerConfig(weight_decay=0.1, clip_grad=1.0))
    _set_grads(0, local.params)
    exact = torch.cat([p.grad.double().flatten() for p in local.params]).norm()
    norm, skipped = local.step()
    assert not skipped
    torch.testing.assert_close(norm.double(), exact, rtol=1e-5, atol=0)


@pytest.mark.skipif(kernel._INTERPRET, reason="under TRITON_INTERPRET=1 the kernel serves CPU tensors")
def test_dtensor_shards_the_kernel_cannot_serve_take_torchs_foreach_step_with_the_clip_and_the_skip():
    """FSDP2 shards of several meshes (dense and experts) where the kernel does not serve the step (here:
    no GPU): torch's foreach step over the same fused-layout state, with the clipping factor applied and a
    non-finite flag skipping the update, decided on the host."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        meshes = [init_device_mesh("cpu", (1,), mesh_dim_names=(name,)) for name in ("dense", "experts")]
        plain = _params(torch.float32, "cpu", CPU_SIZES)
        sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), meshes[i % 2],
                                                        [Shard(0) if p.ndim else Replicate()]))
                   for i, p in enumerate(plain)]
        ours = TritonAdamW(_groups(sharded), lr=1e-3, betas=BETAS, eps=EPS, fused=True)
        theirs = torch.optim.AdamW(_groups(plain), lr=1e-3, betas=BETAS, eps=EPS, foreach=True)
        coef = torch.tensor(0.5)
        for step, found_inf in ((0, 0.0), (1, 1.0), (2, 0.0)):
            _set_grads(step, plain)
            for s, p in zip(sharded, plain):
                s.grad = distribute_tensor(p.grad.clone(), s.device_mesh, s.placements)
            before = [s.to_local().clone() for s in sharded]
            ours.step(grad_coef=coef, found_inf=torch.tensor(found_inf))
            if found_inf:
                assert all(torch.equal(s.to_local(), b) for s, b in zip(sharded, before)), "a skip wrote"
                continue
            for p in plain:
                p.grad.mul_(coef)
            theirs.step()
            for s, p in zip(sharded, plain):
                assert isinstance(s, DTensor)
                torch.testing.assert_close(s.to_local(), p.detach(), rtol=1e-6, atol=1e-7)
    finally:
        dist.destroy_process_group()
