"""AdamW's update as one Triton launch per parameter group and dtype, with torch's fused CUDA numerics.

On one GPU the optimizer step is pure streaming: read parameter, gradient and both moments, write parameter
and both moments, 14 bytes per bf16 parameter. torch's fused AdamW (multi_tensor_apply) runs it at 1.3-1.5x
the copy-bandwidth floor (scripts/adamw_floor.py, issue 15): its launches cover at most 320 chunks of 64k
elements (and 36 tensors) each, so a 4B-parameter step is ~200 launches that each fill part of the GPU and
drain to a tail, and it loads 4 elements per thread at a time (8 bytes of bf16).

`TritonAdamW` is torch.optim.AdamW with the same constructor, param groups and state (`step`, `exp_avg`,
`exp_avg_sq`, laid out exactly as AdamW(fused=True) keeps them, so checkpoints are interchangeable). Its step
runs `_adamw_kernel`:

- one launch per (param group, dtype) over every tensor of it: a table of pointers (param, grad, moments,
  step) in device memory, and a map from program to tensor; each program updates one chunk of CHUNK
  elements of one tensor. Big tensors get many programs, a norm weight gets one, and nothing pays a launch
  of its own. The tables are built once per set of parameter and state addresses; a step whose gradients
  landed elsewhere (zero_grad frees them) rewrites only the gradient column;
- tiles of BLOCK elements, 8 per thread: one 16-byte load per thread and tensor for bf16. Only a tensor's
  last tile is masked, so the others vectorise;
- the update is torch's `adam_math` (aten/src/ATen/native/cuda/fused_adam_utils.cuh) operation for
  operation, all in fp32 ("opmath", the hyper-parameters cast to float once): the moments as its nested
  fmas, the bias corrections from the device-side step, IEEE-rounded sqrt and division, results stored in
  the tensor's dtype. Measured on an H100 against torch 2.11's fused AdamW: 2 of 14.8M bf16 elements
  differ, by 1 ulp; fp32 values within 1.1e-6 relative (tests/test_adamw_kernel.py).

Anything else (DTensor shards, amsgrad, maximize, capturable, a tensor lr, a GradScaler, no Triton, not
fused=True) takes torch's own step. TRITON_INTERPRET=1 runs the kernel on CPU tensors too (slow; for
debugging without a GPU).
"""

from __future__ import annotations

import contextlib
import itertools
import os

import torch
from torch.distributed.tensor import DTensor

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU installs: TritonAdamW is torch's AdamW
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _pow(base, exp, INTERPRET: tl.constexpr):
        if INTERPRET:
            return tl.exp(tl.log(base) * exp)  # the interpreter has no libdevice
        else:
            return libdevice.pow(base, exp)  # fp32: __nv_powf, what pow_(float, float) is in the CUDA kernel

    @triton.jit
    def _cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
        if INTERPRET and dtype == tl.bfloat16:
            # the interpreter truncates fp32 -> bf16: round to nearest even by hand, as the GPU's cvt.rn
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

    @triton.jit
    def _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, offs, size, lr, weight_decay, beta1, beta2, eps,
                    step_size, bc2_sqrt, grad_coef, DECAY: tl.constexpr, SCALE: tl.constexpr,
                    MASKED: tl.constexpr, INTERPRET: tl.constexpr):
        if MASKED:
            mask = offs < size
            p = tl.load(p_ptr + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
            g = tl.load(g_ptr + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
            m = tl.load(m_ptr + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
            v = tl.load(v_ptr + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
        else:
            p = tl.load(p_ptr + offs, eviction_policy="evict_first").to(tl.float32)
            g = tl.load(g_ptr + offs, eviction_policy="evict_first").to(tl.float32)
            m = tl.load(m_ptr + offs, eviction_policy="evict_first").to(tl.float32)
            v = tl.load(v_ptr + offs, eviction_policy="evict_first").to(tl.float32)
        dtype: tl.constexpr = p_ptr.dtype.element_ty
        if SCALE:  # clipping as torch's _foreach_mul_(grads, coef) does it: the factor in the gradients'
            # dtype, the product in fp32, rounded to that dtype
            coef = _cast(grad_coef, dtype, INTERPRET).to(tl.float32)
            g = _cast(g * coef, dtype, INTERPRET).to(tl.float32)
        # adam_math (fused_adam_utils.cuh), ADAMW mode, as torch's kernel does it: everything in fp32
        # ("opmath", the hyper-parameters cast to float once), nvcc's contraction of a - b * c into an fma,
        # IEEE-rounded sqrt and division (Triton's plain `/` is approximate)
        if DECAY:
            p = tl.fma(-(lr * weight_decay), p, p)
        m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
        gg = g * g
        v = tl.fma(beta2, v, tl.fma(-beta2, gg, gg))
        denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.math.div_rn(step_size * m, denom)
        p, m, v = _cast(p, dtype, INTERPRET), _cast(m, dtype, INTERPRET), _cast(v, dtype, INTERPRET)
        if MASKED:
            tl.store(p_ptr + offs, p, mask=mask)
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)
        else:
            tl.store(p_ptr + offs, p)
            tl.store(m_ptr + offs, m)
            tl.store(v_ptr + offs, v)

    @triton.jit
    def _adamw_kernel(table_ptr, program_tensor_ptr, hyper_ptr, grad_coef_ptr, found_inf_ptr,
                      DTYPE: tl.constexpr, DECAY: tl.constexpr, SCALE: tl.constexpr, SKIP: tl.constexpr,
                      ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                      INTERPRET: tl.constexpr):
        # the hyper-parameters, cast to fp32 as torch's kernel does, from device memory (no recompilation
        # or argument specialisation when the lr changes)
        lr, weight_decay = tl.load(hyper_ptr + 0), tl.load(hyper_ptr + 1)
        beta1, beta2, eps = tl.load(hyper_ptr + 2), tl.load(hyper_ptr + 3), tl.load(hyper_ptr + 4)
        grad_coef = tl.load(grad_coef_ptr) if SCALE else 1.0  # the clipping factor, computed on the device
        pid = tl.program_id(0)
        row = table_ptr + tl.load(program_tensor_ptr + pid).to(tl.int64) * 8  # rows of _build_launches
        p_ptr = tl.load(row + 0).to(tl.pointer_type(DTYPE))
        g_ptr = tl.load(row + 1).to(tl.pointer_type(DTYPE))
        m_ptr = tl.load(row + 2).to(tl.pointer_type(DTYPE))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(DTYPE))
        if ALIGNED:  # the host checked: every address 16-byte aligned, so tiles load as 16-byte vectors
            p_ptr, g_ptr = tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16)
            m_ptr, v_ptr = tl.multiple_of(m_ptr, 16), tl.multiple_of(v_ptr, 16)
        start = (pid - tl.load(row + 6)) * CHUNK  # this program's chunk of its tensor
        size = tl.minimum(tl.load(row + 5) - start, CHUNK).to(tl.int32)
        if SKIP:  # a non-finite gradient norm, found on the device: no tile is read or written
            size = tl.where(tl.load(found_inf_ptr) != 0, 0, size)
        p_ptr, g_ptr, m_ptr, v_ptr = p_ptr + start, g_ptr + start, m_ptr + start, v_ptr + start

        # bias corrections in fp32 from the step the host incremented on the device (no host sync)
        step = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32)))
        bc1 = 1.0 - _pow(beta1, step, INTERPRET)
        step_size = tl.math.div_rn(lr, bc1)
        bc2_sqrt = tl.sqrt_rn(1.0 - _pow(beta2, step, INTERPRET))

        full = size // BLOCK * BLOCK
        for off in range(0, full, BLOCK):
            _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, off + tl.arange(0, BLOCK), size, lr, weight_decay,
                        beta1, beta2, eps, step_size, bc2_sqrt, grad_coef, DECAY, SCALE, MASKED=False,
                        INTERPRET=INTERPRET)
        if full < size:
            _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, full + tl.arange(0, BLOCK), size, lr, weight_decay,
                        beta1, beta2, eps, step_size, bc2_sqrt, grad_coef, DECAY, SCALE, MASKED=True,
                        INTERPRET=INTERPRET)

    @triton.jit
    def _square_sum_kernel(table_ptr, program_tensor_ptr, out_ptr, DTYPE: tl.constexpr,
                           ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # the sum of squares of one chunk of one gradient, in fp32, over the AdamW launch's own tables
        pid = tl.program_id(0)
        row = table_ptr + tl.load(program_tensor_ptr + pid).to(tl.int64) * 8  # rows of _build_launches
        g_ptr = tl.load(row + 1).to(tl.pointer_type(DTYPE))
        if ALIGNED:
            g_ptr = tl.multiple_of(g_ptr, 16)
        start = (pid - tl.load(row + 6)) * CHUNK
        size = tl.minimum(tl.load(row + 5) - start, CHUNK).to(tl.int32)
        g_ptr = g_ptr + start
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        full = size // BLOCK * BLOCK
        for off in range(0, full, BLOCK):
            g = tl.load(g_ptr + off + tl.arange(0, BLOCK)).to(tl.float32)
            acc += g * g
        if full < size:
            offs = full + tl.arange(0, BLOCK)
            g = tl.load(g_ptr + offs, mask=offs < size, other=0.0).to(tl.float32)
            acc += g * g
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


class TritonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose fused step runs `_adamw_kernel` (module docstring): construct it with
    fused=True, as one would torch's fused AdamW. Same param groups, state and state_dict as that; `lr` may
    change in param_groups between steps (LRSchedule sets it). Every other setting steps through torch."""

    chunk = 65536  # elements per program: a 4B-parameter step is ~66k programs, its tables ~0.3 MB
    block = 2048  # elements per tile: num_warps * 32 threads * 8 elements (one 16-byte bf16 vector each)
    num_warps = 8

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (a group's parameter and state addresses and sizes, chunk) -> (its launches, tables on the device;
        # the gradient addresses each table holds): see _launches
        self._tables: dict[tuple, tuple[list[tuple], list[tuple]]] = {}

    @torch.no_grad()
    def step(self, closure=None, grad_coef: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None):
        """One AdamW step. `grad_coef` (a scalar tensor on the parameters' device, e.g. gradient clipping's
        min(1, max_norm / norm)) scales every gradient first, exactly as torch._foreach_mul_ would (fp32
        product rounded to the gradient's dtype). The kernel applies it as it reads each gradient, which
        saves clipping's own pass over them (a read and a write of every gradient: 7 ms of a 4B-parameter
        step); the gradients themselves are left unscaled. torch's step scales them in place first.

        `found_inf` (a 0-dim float tensor on the device, 1.0 or 0.0) skips the step where it is 1: no
        parameter, moment or step count changes, as torch's fused step does it for a GradScaler. The host
        never reads it, so a step's update is queued behind its backward without waiting for it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._plan()
        if plan is None:
            params = [p for group in self.param_groups for p in group["params"]]
            if grad_coef is not None:
                from mlite.runtime.optim import scale_grads_

                scale_grads_(params, grad_coef)
            if any(isinstance(p, DTensor) for p in params):
                # shards of several meshes (dense, experts), which one fused call cannot take: torch's
                # foreach step, the skip decided on the host
                if found_inf is None or not bool(found_inf):
                    self._torch_step(None, foreach=True)
                return loss
            self.found_inf = found_inf  # torch's fused step skips on it (and takes the step count back)
            try:
                self._torch_step(None)
            finally:
                self.found_inf = None
            return loss
        steps, launches = plan
        if steps:
            torch._foreach_add_(steps, 1)  # as torch's fused step: the kernel reads the new count
            if found_inf is not None:  # as torch's fused step: a skipped step does not count
                torch._foreach_sub_(steps, [found_inf.to(steps[0].device, torch.float32)] * len(steps))
        for group, device, dtype, aligned, table, program_tensor in launches:
            beta1, beta2 = group["betas"]
            hyper = _to_device(torch.tensor([group["lr"], group["weight_decay"], beta1, beta2, group["eps"]],
                                            dtype=torch.float32), device)
            coef = hyper if grad_coef is None else grad_coef.to(device, torch.float32)
            skip = hyper if found_inf is None else found_inf.to(device, torch.float32)
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                _adamw_kernel[(program_tensor.numel(),)](
                    table, program_tensor, hyper, coef, skip, DTYPE=_TL_DTYPES[dtype],
                    DECAY=group["weight_decay"] != 0, SCALE=grad_coef is not None,
                    SKIP=found_inf is not None, ALIGNED=aligned,
                    CHUNK=self.chunk, BLOCK=self.block,
                    INTERPRET=_INTERPRET, num_warps=self.num_warps,
                    enable_fp_fusion=True,  # mul + add -> fma, as nvcc compiles torch's kernel
                )
        return loss

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor | None:
        """The L2 norm of every gradient the step would read, as a 0-dim fp32 tensor on the device (no host
        sync), or None where the kernel does not serve the step. One launch per (group, dtype) over the
        step's own tables: each program sums the squares of one chunk in fp32, then the chunks' sums add up.
        torch's foreach norm reads the gradients at a fraction of the bandwidth (4.5 ms against a 2.9 ms
        floor on 4.8B bf16 gradients) and rounds each tensor's norm to the gradients' dtype; this one keeps
        fp32 throughout. Non-finite gradients give a non-finite norm, as torch's does."""
        plan = self._plan()
        if plan is None:
            return None
        sums = []
        for _group, device, dtype, aligned, table, program_tensor in plan[1]:
            partial = torch.empty(program_tensor.numel(), dtype=torch.float32, device=device)
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                _square_sum_kernel[(program_tensor.numel(),)](
                    table, program_tensor, partial, DTYPE=_TL_DTYPES[dtype], ALIGNED=aligned,
                    CHUNK=self.chunk, BLOCK=self.block, num_warps=self.num_warps)
            sums.append(partial.sum())
        if not sums:
            return None
        return torch.stack([s.to(sums[0].device) for s in sums]).sum().sqrt()

    def _plan(self) -> tuple[list[torch.Tensor], list[tuple]] | None:
        """The step counts to advance and the launches (group, device, dtype, aligned, table, program map)
        when the kernel serves the whole step, else None. This is host time in front of the first launch,
        so the per-parameter work is kept to reading addresses: a new set of addresses is checked in full
        once (`_launches`); a gradient's dtype, device and size are the parameter's (autograd and the
        .grad setter see to that), its layout is checked every step."""
        if triton is None or getattr(self, "grad_scale", None) is not None or \
                getattr(self, "found_inf", None) is not None:
            return None
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None  # the table cache is host-side work that a CUDA graph would not replay
        for group in self.param_groups:
            if not group["fused"] or group["amsgrad"] or group["maximize"] or group["capturable"] or \
                    group["differentiable"] or not group["decoupled_weight_decay"]:
                return None
            if not all(isinstance(x, (float, int)) for x in (group["lr"], *group["betas"], group["eps"],
                                                              group["weight_decay"])):
                return None  # a tensor lr or beta: torch's step handles it
        all_steps, launches = [], []
        for group in self.param_groups:
            tensors, rows = [], []
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if not state:  # lazy state init, as torch's step does it (fused layout: fp32 step on device)
                    self._init_group(group, [], [], [], [], [], [])
                m, v, s = state["exp_avg"], state["exp_avg_sq"], state["step"]
                if isinstance(p, DTensor):
                    # FSDP2's shards: the update is elementwise, so this rank updates its local shards (the
                    # clipping factor and the skip flag come from the norm over every rank)
                    if not all(isinstance(t, DTensor) and t.placements == p.placements and
                               t.device_mesh == p.device_mesh for t in (g, m, v)):
                        return None
                    p, g, m, v = p.to_local(), g.to_local(), m.to_local(), v.to_local()
                if type(p) not in _PLAIN or type(g) is not torch.Tensor or g.layout != torch.strided or \
                        not g.is_contiguous():
                    return None  # DTensor or other subclass, a sparse or strided gradient: torch's step
                tensors.append((p, g, m, v, s))
                rows.append((p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), s.data_ptr(), p.numel()))
            group_launches = self._launches(tensors, rows)
            if group_launches is None:
                return None
            all_steps += [t[4] for t in tensors]
            launches += [(group, *launch) for launch in group_launches]
        return all_steps, launches

    def _launches(self, tensors: list[tuple], rows: list[tuple]) -> list[tuple] | None:
        """A group's launches, (device, dtype, aligned, pointer table, program -> tensor map), one per kind
        of tensor; None if the kernel cannot take one of them. Cached by the addresses and sizes of the
        parameters and their state, which stay put. Gradients are freed by zero_grad and land at new
        addresses most steps: then only the table's gradient column is rewritten (one small asynchronous
        copy), not the whole table and program map (whose host work once cost ~4 ms a step on 1.7B)."""
        key = (tuple(row[:1] + row[2:] for row in rows), self.chunk)  # all but the gradients' addresses
        cached = self._tables.get(key)
        if cached is None:
            cached = self._build_launches(tensors, rows)
            if cached is None:
                return None
            if len(self._tables) >= 16:  # addresses moved for good (loaded state, new parameters)
                self._tables.clear()
            self._tables[key] = cached
        launches, grad_rows = cached
        for (device, _dtype, aligned, table, _), (indices, known) in zip(launches, grad_rows):
            grads = [rows[i][1] for i in indices]
            if grads != known:
                if aligned and any(g % 16 for g in grads):
                    return None  # a gradient off 16-byte alignment: torch's step
                table[:, 1].copy_(_to_device(torch.tensor(grads, dtype=torch.int64), device),
                                  non_blocking=True)
                known[:] = grads
        return launches

    def _build_launches(self, tensors: list[tuple], rows: list[tuple]) -> tuple[list, list] | None:
        """(launches, per launch: its rows' indices and the gradient addresses its table holds)."""
        if not all(_servable(*t) for t in tensors):
            return None
        kinds: dict[tuple, list[int]] = {}
        for i, ((p, *_), row) in enumerate(zip(tensors, rows)):
            aligned = (row[0] | row[1] | row[2] | row[3]) % 16 == 0  # 16-byte vectors need 16-byte addresses
            if not aligned:  # a view off its storage's start: torch's step (the allocator aligns the rest)
                return None
            kinds.setdefault((p.device, p.dtype, aligned), []).append(i)
        launches, grad_rows = [], []
        for (device, dtype, aligned), indices in kinds.items():
            kind_rows = [rows[i] for i in indices]
            counts = [-(-numel // self.chunk) for *_, numel in kind_rows]  # programs per tensor
            if sum(counts) == 0:
                continue
            firsts = [0, *itertools.accumulate(counts)][:-1]
            table = torch.tensor([(*row, first, 0) for row, first in zip(kind_rows, firsts)],
                                 dtype=torch.int64)
            program_tensor = torch.repeat_interleave(torch.arange(len(kind_rows), dtype=torch.int32),
                                                     torch.tensor(counts))
            launches.append((device, dtype, aligned, _to_device(table, device),
                             _to_device(program_tensor, device)))
            grad_rows.append((indices, [row[1] for row in kind_rows]))
        return launches, grad_rows

    def _torch_step(self, closure, foreach: bool = False):
        # torch.optim.AdamW.step without the profiling/hook wrapper Optimizer may have put on it: ours
        # already ran the hooks. `foreach`: its foreach implementation over the same (fused-layout) state
        step = torch.optim.AdamW.step
        step = step.__wrapped__ if getattr(step, "hooked", False) else step
        if not foreach:
            return step(self, closure)
        flags = [(group["fused"], group["foreach"]) for group in self.param_groups]
        for group in self.param_groups:
            group["fused"], group["foreach"] = False, True
        try:
            return step(self, closure)
        finally:
            for group, (fused, foreach_flag) in zip(self.param_groups, flags):
                group["fused"], group["foreach"] = fused, foreach_flag


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _servable(p, g, m, v, s) -> bool:
    """A tensor the kernel updates: plain dense contiguous tensors (no DTensor or other subclass) of one
    dtype it handles, on one GPU (or the CPU under the Triton interpreter), with torch's fused state layout
    (moments like the parameter, an fp32 step on its device)."""
    return (
        type(p) in _PLAIN and type(g) is torch.Tensor
        and (p.is_cuda or (_INTERPRET and p.device.type == "cpu"))
        and p.dtype in _TL_DTYPES and g.dtype == p.dtype and m.dtype == p.dtype and v.dtype == p.dtype
        and s.dtype == torch.float32 and p.device == g.device == m.device == v.device == s.device
        and p.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous()
        and g.shape == p.shape and m.shape == p.shape and v.shape == p.shape
    )


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return t
    # through pinned memory: an asynchronous copy, no host sync in the step
    return t.pin_memory().to(device, non_blocking=True)
