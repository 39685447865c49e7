"""AdamW's update as one Triton launch per parameter group and dtype, with torch's fused CUDA numerics.

On one GPU the optimizer step is pure streaming: read parameter, gradient and both moments, write parameter
and both moments, 14 bytes per bf16 parameter. torch's fused AdamW (multi_tensor_apply) runs it at 1.3-1.5x
the copy-bandwidth floor (scripts/adamw_floor.py): its launches cover at most 320 chunks of 64k
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

FSDP2's DTensor parameters are served through their local shards (the update is elementwise), and a
wrapper subclass around plain data (torchao's FP8-gathered weight) through the data it wraps. Anything
else (shards whose state is laid out otherwise, amsgrad, maximize, capturable, a tensor lr, a GradScaler, no
Triton, not fused=True) takes torch's own step. TRITON_INTERPRET=1 runs the kernel on CPU tensors too (slow;
for debugging without a GPU).

`Fp8StateAdamW` (the last section) is the same launch over the same tables with both moments stored in
float8 e4m3 with block scales: precision.optimizer_state: fp8.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os

import torch
from torch.distributed.tensor import DTensor

from mlite.runtime.adapters.pytorch import foreach_add_, foreach_sub_, wrapped_data
from mlite.runtime.kernels.grads import scale_grads_

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
                      INTERPRET: tl.constexpr, ROW: tl.constexpr = 8):
        # the hyper-parameters, cast to fp32 as torch's kernel does, from device memory (no recompilation
        # or argument specialisation when the lr changes)
        lr, weight_decay = tl.load(hyper_ptr + 0), tl.load(hyper_ptr + 1)
        beta1, beta2, eps = tl.load(hyper_ptr + 2), tl.load(hyper_ptr + 3), tl.load(hyper_ptr + 4)
        grad_coef = tl.load(grad_coef_ptr) if SCALE else 1.0  # the clipping factor, computed on the device
        pid = tl.program_id(0)
        row = table_ptr + tl.load(program_tensor_ptr + pid).to(tl.int64) * ROW  # rows of _build_launches
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
                           ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                           ROW: tl.constexpr):
        # the sum of squares of one chunk of one gradient, in fp32, over the AdamW launch's own tables
        pid = tl.program_id(0)
        row = table_ptr + tl.load(program_tensor_ptr + pid).to(tl.int64) * ROW  # rows of _build_launches
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
    # (block, num_warps) by GPU name where another tile measured faster: an H200's memory (4.2 TB/s copies
    # against an H100's 2.9) wants more bytes in flight per program. In the bench step on one H200 4096 x 16
    # beat 2048 x 8 by 1.1 ms (MoE) and 0.5 ms (dense) (docs/PERFORMANCE.md, "What the defaults rest on")
    tiles_by_gpu = {"H200": (4096, 16)}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        first = next((p for group in self.param_groups for p in group["params"]), None)
        if first is not None and first.is_cuda:
            self.block, self.num_warps = self.tile_for(torch.cuda.get_device_name(first.device))
        # (a group's parameter and state addresses and sizes, chunk) -> (its launches, tables on the device;
        # the gradient addresses each table holds): see _launches
        self._tables: dict[tuple, tuple[list[tuple], list[tuple]]] = {}

    @classmethod
    def tile_for(cls, gpu_name: str) -> tuple[int, int]:
        """The kernels' (block, num_warps) on the GPU of this name."""
        return next((tile for key, tile in cls.tiles_by_gpu.items() if key in gpu_name),
                    (cls.block, cls.num_warps))

    @torch.no_grad()
    def step(self, closure=None, grad_coef: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None):
        """One AdamW step. `grad_coef` (a scalar tensor on the parameters' device, e.g. gradient clipping's
        min(1, max_norm / norm)) scales every gradient first, exactly as a foreach multiply would (fp32
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
            self._fallback_step(grad_coef, found_inf)
            return loss
        steps, launches = plan
        if steps:
            foreach_add_(steps, 1)  # as torch's fused step: the kernel reads the new count
            if found_inf is not None:  # as torch's fused step: a skipped step does not count
                foreach_sub_(steps, [found_inf.to(steps[0].device, torch.float32)] * len(steps))
        for group, device, dtype, aligned, table, program_tensor in launches:
            beta1, beta2 = group["betas"]
            hyper = _to_device(torch.tensor([group["lr"], group["weight_decay"], beta1, beta2, group["eps"]],
                                            dtype=torch.float32), device)
            coef = hyper if grad_coef is None else grad_coef.to(device, torch.float32)
            skip = hyper if found_inf is None else found_inf.to(device, torch.float32)
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                self._launch(group, dtype, aligned, table, program_tensor, hyper, coef, skip,
                             scale=grad_coef is not None, skip_on_inf=found_inf is not None)
        return loss

    def _launch(self, group, dtype, aligned, table, program_tensor, hyper, coef, skip, scale: bool,
                skip_on_inf: bool) -> None:
        _adamw_kernel[(program_tensor.numel(),)](
            table, program_tensor, hyper, coef, skip, DTYPE=_TL_DTYPES[dtype],
            DECAY=group["weight_decay"] != 0, SCALE=scale, SKIP=skip_on_inf, ALIGNED=aligned,
            CHUNK=self.chunk, BLOCK=self.block, INTERPRET=_INTERPRET, num_warps=self.num_warps,
            enable_fp_fusion=True,  # mul + add -> fma, as nvcc compiles torch's kernel
        )

    def _fallback_step(self, grad_coef: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """The step where the kernel does not serve it: torch's own."""
        params = [p for group in self.param_groups for p in group["params"]]
        if grad_coef is not None:
            scale_grads_(params, grad_coef)
        if any(isinstance(p, DTensor) for p in params):
            # shards of several meshes (dense, experts), which one fused call cannot take: torch's
            # foreach step, the skip decided on the host
            if found_inf is None or not bool(found_inf):
                self._torch_step(None, foreach=True)
            return
        self.found_inf = found_inf  # torch's fused step skips on it (and takes the step count back)
        try:
            self._torch_step(None)
        finally:
            self.found_inf = None

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
                    CHUNK=self.chunk, BLOCK=self.block, ROW=table.shape[1], num_warps=self.num_warps)
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
                if not state:  # lazy state init, as torch's step does it
                    self._init_state(group)
                m, v, s = state["exp_avg"], state["exp_avg_sq"], state["step"]
                extra = self._extra_state(state)
                if isinstance(p, DTensor):
                    # FSDP2's shards: the update is elementwise, so this rank updates its local shards (the
                    # clipping factor and the skip flag come from the norm over every rank)
                    local = self._local_shards(p, g, m, v)
                    if local is None:
                        return None
                    p, g, m, v = local
                # a wrapper around plain data (torchao's weight that FSDP2 gathers in FP8, and the moments
                # torch's step made like it): the kernel updates the data it wraps
                p, g, m, v = (t if type(t) in _PLAIN else wrapped_data(t) for t in (p, g, m, v))
                if type(p) not in _PLAIN or type(g) is not torch.Tensor or m is None or v is None or \
                        g.layout != torch.strided or not g.is_contiguous():
                    return None  # DTensor or other subclass, a sparse or strided gradient: torch's step
                tensors.append((p, g, m, v, s, *extra))
                rows.append((p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), s.data_ptr(), p.numel(),
                             *(t.data_ptr() for t in extra)))
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
        if not all(self._servable(*t) for t in tensors):
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
            counts = [-(-row[5] // self.chunk) for row in kind_rows]  # programs per tensor (row[5]: numel)
            if sum(counts) == 0:
                continue
            firsts = [0, *itertools.accumulate(counts)][:-1]
            # a row: param, grad, exp_avg, exp_avg_sq, step, numel, first program, any extra state, 0
            table = torch.tensor([(*row[:6], first, *row[6:], 0) for row, first in zip(kind_rows, firsts)],
                                 dtype=torch.int64)
            program_tensor = torch.repeat_interleave(torch.arange(len(kind_rows), dtype=torch.int32),
                                                     torch.tensor(counts))
            launches.append((device, dtype, aligned, _to_device(table, device),
                             _to_device(program_tensor, device)))
            grad_rows.append((indices, [row[1] for row in kind_rows]))
        return launches, grad_rows

    def _init_state(self, group: dict) -> None:
        """The group's state, as torch's fused step creates it (moments like the parameter, an fp32 step on
        its device)."""
        self._init_group(group, [], [], [], [], [], [])

    def _extra_state(self, state: dict) -> tuple[torch.Tensor, ...]:
        """State tensors beyond the moments and the step that the kernel reads (their addresses follow the
        first program's in each table row)."""
        return ()

    def _servable(self, p, g, m, v, s, *extra) -> bool:
        return _servable(p, g, m, v, s)

    def _local_shards(self, p, g, m, v) -> tuple | None:
        """This rank's shards of a DTensor parameter, its gradient and moments (None: torch's step)."""
        if not all(isinstance(t, DTensor) and t.placements == p.placements and t.device_mesh == p.device_mesh
                   for t in (g, m, v)):
            return None
        return p.to_local(), g.to_local(), m.to_local(), v.to_local()

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


# ---------------------------------------------------------------------------------- fp8 optimizer state
# precision.optimizer_state: fp8 keeps both Adam moments as float8 e4m3 with one power-of-two scale per
# block of FP8_BLOCK consecutive elements (2 bytes of state per parameter instead of 4 in bf16 or 8 in fp32;
# the idea of torchao's AdamWFp8 and MindSpeed's quantised states). What is stored:
#
# - exp_avg: m / scale, and exp_avg_sq: sqrt(v) / scale. The square root halves v's dynamic range in
#   binades (a block holds gradients 2e5 apart in size where v itself would flush the small ones to zero,
#   and a zero denominator turns a tiny moment into a huge update);
# - each block's scale is the smallest power of two that brings its largest magnitude under 448 (e4m3's
#   largest finite value): exact to apply and undo, so decoding is exact and a checkpoint's dequantised
#   moments quantise back to the same values;
# - rounding is stochastic (unbiased; 16 random bits per element and moment): e4m3 has 3 mantissa bits,
#   and the moments' per-step change ((1 - beta2) g^2 on v, 5% at beta2 0.95) is below half a unit in the
#   last place, so round-to-nearest would freeze v wherever gradients shrink. The random bits come from the
#   step count, the tensor and the element, so a resumed run draws what the uninterrupted one drew.
#
# The update itself is AdamW's, in fp32, on the decoded moments; only storage rounds. `fp8_adamw_reference`
# is the pure-torch step (CPU runs, and the GPU kernel's reference); `_adamw_fp8_kernel` is the same step as
# one Triton launch per (group, dtype), over TritonAdamW's tables.
FP8_BLOCK = 128
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def _exp2i(k: torch.Tensor) -> torch.Tensor:
    """2**k for integer k in [-126, 127], exactly, from the fp32 bits."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def fp8_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest k with amax <= 448 * 2**k (int32), read off amax's bits: amax = M * 2**E with M in [1, 2)
    needs k = E - 8, or E - 7 when M > 1.75 (448 = 1.75 * 2**8). Zero blocks get k = 0."""
    bits = amax.view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return torch.where(amax > 0, k, 0).clamp(-126, 127)


def fp8_round(x: torch.Tensor, noise: torch.Tensor | float) -> torch.Tensor:
    """x (fp32, |x| <= 448) rounded onto e4m3's grid: floor(|x| / ulp + noise) * ulp with the sign, where ulp
    is e4m3's spacing at |x| (2**(e - 3), at least 2**-9 in its subnormal range). noise uniform in [0, 1):
    stochastic rounding; 0.5: round half up (tests compare the kernel with this). The result is exact in
    e4m3, so the cast that follows does not round again."""
    a = x.abs()
    u = ((((a.view(torch.int32) >> 23) & 0xFF) - 127) - 3).clamp(min=-9)
    q = torch.floor(a * _exp2i(-u) + noise) * _exp2i(u)
    return torch.copysign(q.clamp(max=FP8_MAX), x)


def _as_blocks(x: torch.Tensor) -> torch.Tensor:
    """x flattened to fp32 and zero-padded into rows of FP8_BLOCK: [ceil(numel / FP8_BLOCK), FP8_BLOCK]."""
    blocks = -(-x.numel() // FP8_BLOCK)
    flat = x.reshape(-1).float()
    return torch.nn.functional.pad(flat, (0, blocks * FP8_BLOCK - flat.numel())).view(blocks, FP8_BLOCK)


def fp8_encode(x: torch.Tensor, noise: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, fp32) -> (e4m3 values shaped like x, fp32 scales [ceil(numel / FP8_BLOCK)])."""
    blocks = _as_blocks(x)
    k = fp8_scale_exponent(blocks.abs().amax(dim=1))
    if isinstance(noise, torch.Tensor):
        noise = _as_blocks(noise)
    q = fp8_round(blocks * _exp2i(-k)[:, None], noise)
    return q.reshape(-1)[: x.numel()].view(x.shape).to(FP8_DTYPE), _exp2i(k)


def fp8_decode(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(e4m3 values, block scales) -> fp32 shaped like q."""
    return (_as_blocks(q) * scale[:, None]).reshape(-1)[: q.numel()].view(q.shape)


def fp8_noise(like: torch.Tensor, seed: int, step: int, index: int) -> torch.Tensor:
    """Uniform [0, 1) fp32 noise shaped like `like`, a function of (seed, step, tensor index) alone."""
    generator = torch.Generator(device=like.device)
    generator.manual_seed((seed * 1_000_003 + step * 65_537 + index) % 2**63)
    return torch.rand(like.shape, generator=generator, device=like.device, dtype=torch.float32)


def fp8_adamw_reference(p, g, state: dict, *, lr: float, beta1: float, beta2: float, eps: float,
                        weight_decay: float, noise: tuple[torch.Tensor, torch.Tensor] | float) -> None:
    """One AdamW step of parameter p (in place) with the fp8 moments in `state` (its step count already
    advanced): decode, update in fp32 exactly as AdamW, encode the new moments with `noise` (a pair of
    noise tensors, or 0.5 for round half up)."""
    step = float(state["step"])
    noise_m, noise_v = noise if isinstance(noise, tuple) else (noise, noise)
    pf, gf = p.float(), g.float()
    m = fp8_decode(state["exp_avg"], state["exp_avg_scale"])
    v = fp8_decode(state["exp_avg_sq"], state["exp_avg_sq_scale"]).square()
    if weight_decay:
        pf = pf * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * gf
    v = beta2 * v + (1 - beta2) * gf * gf
    step_size = lr / (1 - beta1**step)
    bc2_sqrt = math.sqrt(1 - beta2**step)
    root = v.sqrt()
    p.copy_(pf - step_size * m / (root / bc2_sqrt + eps))
    state["exp_avg"], state["exp_avg_scale"] = fp8_encode(m, noise_m)
    state["exp_avg_sq"], state["exp_avg_sq_scale"] = fp8_encode(root, noise_v)


if triton is not None:

    @triton.jit
    def _exp2i_tl(k):
        return ((k + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp8_round_tl(x, noise):  # fp8_round
        a = tl.abs(x)
        u = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 3, -9)
        q = tl.minimum(tl.floor(a * _exp2i_tl(-u) + noise) * _exp2i_tl(u), 448.0)
        return tl.where(x < 0, -q, q)

    @triton.jit
    def _fp8_exponent_tl(amax):  # fp8_scale_exponent over a block's largest magnitude
        bits = amax.to(tl.int32, bitcast=True)
        k = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        return tl.minimum(tl.maximum(tl.where(amax > 0, k, 0), -126), 127)

    @triton.jit
    def _hash_tl(x):
        # a 32-bit integer hash (Wellons' lowbias32): 2 multiplies and 3 shifts per element. Triton's Philox
        # (tl.randint4x) cost 20 ms of a 4.8B-parameter step, twice the update itself
        x ^= x >> 16
        x *= 0x7FEB352D
        x ^= x >> 15
        x *= 0x846CA68B
        x ^= x >> 16
        return x

    # one tile's whole update, step for step in fp8_adamw_reference's order, to be read against it
    @triton.jit
    def _adamw_fp8_tile(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, tile, start, size, seed, lr,
                        weight_decay, beta1, beta2, eps, step_size, bc2_sqrt, grad_coef,
                        DECAY: tl.constexpr, SCALE: tl.constexpr, STOCHASTIC: tl.constexpr,
                        MASKED: tl.constexpr, QB: tl.constexpr, ROWS: tl.constexpr,
                        INTERPRET: tl.constexpr):
        # a [ROWS, QB] tile: one row per scale block
        blocks = tile // QB + tl.arange(0, ROWS)
        offs = blocks[:, None] * QB + tl.arange(0, QB)[None, :]
        dtype: tl.constexpr = p_ptr.dtype.element_ty
        if MASKED:
            mask = offs < size
            block_mask = blocks * QB < size
            p = tl.load(p_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            mq = tl.load(m_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            vq = tl.load(v_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            ms = tl.load(ms_ptr + blocks, mask=block_mask, other=1.0)
            vs = tl.load(vs_ptr + blocks, mask=block_mask, other=1.0)
        else:
            p = tl.load(p_ptr + offs, eviction_policy="evict_first").to(tl.float32)
            g = tl.load(g_ptr + offs, eviction_policy="evict_first").to(tl.float32)
            mq = tl.load(m_ptr + offs, eviction_policy="evict_first").to(tl.float32)
            vq = tl.load(v_ptr + offs, eviction_policy="evict_first").to(tl.float32)
            ms = tl.load(ms_ptr + blocks)
            vs = tl.load(vs_ptr + blocks)
        if SCALE:  # clipping, as in _adamw_tile
            coef = _cast(grad_coef, dtype, INTERPRET).to(tl.float32)
            g = _cast(g * coef, dtype, INTERPRET).to(tl.float32)
        m = mq * ms[:, None]
        root = vq * vs[:, None]
        v = root * root
        if DECAY:
            p = tl.fma(-(lr * weight_decay), p, p)
        m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
        gg = g * g
        v = tl.fma(beta2, v, tl.fma(-beta2, gg, gg))
        # Zero moments (the rows of an input embedding that no token of the batch used: 97% of the MoE
        # bench's) send IEEE sqrt and division down their slow paths, which this kernel, bound by its
        # arithmetic, pays in full (28.7 ms against 21.8 ms on the MoE bench's parameters). Those lanes
        # compute on 1.0 and take the exact result, 0, back.
        v_zero, m_zero = v == 0, m == 0
        root = tl.where(v_zero, 0.0, tl.sqrt_rn(tl.where(v_zero, 1.0, v)))
        denom = tl.where(v_zero, 0.0, tl.math.div_rn(tl.where(v_zero, 1.0, root), bc2_sqrt)) + eps
        p = p - tl.where(m_zero, 0.0, tl.math.div_rn(tl.where(m_zero, 1.0, step_size * m), denom))
        km = _fp8_exponent_tl(tl.max(tl.abs(m), axis=1))
        kv = _fp8_exponent_tl(tl.max(root, axis=1))
        if STOCHASTIC:  # 16 random bits for each moment from one hash of (seed, element)
            bits = _hash_tl((start + offs).to(tl.uint32) * 0x9E3779B9 + seed)
            noise_m = (bits & 0xFFFF).to(tl.float32) * 1.52587890625e-05
            noise_v = (bits >> 16).to(tl.float32) * 1.52587890625e-05
        else:
            noise_m, noise_v = 0.5, 0.5
        mq = _fp8_round_tl(m * _exp2i_tl(-km)[:, None], noise_m).to(m_ptr.dtype.element_ty)
        vq = _fp8_round_tl(root * _exp2i_tl(-kv)[:, None], noise_v).to(v_ptr.dtype.element_ty)
        p = _cast(p, dtype, INTERPRET)
        if MASKED:
            tl.store(p_ptr + offs, p, mask=mask)
            tl.store(m_ptr + offs, mq, mask=mask)
            tl.store(v_ptr + offs, vq, mask=mask)
            tl.store(ms_ptr + blocks, _exp2i_tl(km), mask=block_mask)
            tl.store(vs_ptr + blocks, _exp2i_tl(kv), mask=block_mask)
        else:
            tl.store(p_ptr + offs, p)
            tl.store(m_ptr + offs, mq)
            tl.store(v_ptr + offs, vq)
            tl.store(ms_ptr + blocks, _exp2i_tl(km))
            tl.store(vs_ptr + blocks, _exp2i_tl(kv))

    @triton.jit
    def _adamw_fp8_kernel(table_ptr, program_tensor_ptr, hyper_ptr, grad_coef_ptr, found_inf_ptr, base_seed,
                          DTYPE: tl.constexpr, DECAY: tl.constexpr, SCALE: tl.constexpr,
                          SKIP: tl.constexpr, STOCHASTIC: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK: tl.constexpr, QB: tl.constexpr, ROW: tl.constexpr,
                          INTERPRET: tl.constexpr):
        # _adamw_kernel's layout (one program per chunk of one tensor, the hyper-parameters and the step on
        # the device) with the moments in e4m3 and their block scales at row + 7 and row + 8
        lr, weight_decay = tl.load(hyper_ptr + 0), tl.load(hyper_ptr + 1)
        beta1, beta2, eps = tl.load(hyper_ptr + 2), tl.load(hyper_ptr + 3), tl.load(hyper_ptr + 4)
        grad_coef = tl.load(grad_coef_ptr) if SCALE else 1.0
        pid = tl.program_id(0)
        tensor = tl.load(program_tensor_ptr + pid)
        row = table_ptr + tensor.to(tl.int64) * ROW
        p_ptr = tl.load(row + 0).to(tl.pointer_type(DTYPE))
        g_ptr = tl.load(row + 1).to(tl.pointer_type(DTYPE))
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float8e4nv))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float8e4nv))
        ms_ptr = tl.load(row + 7).to(tl.pointer_type(tl.float32))
        vs_ptr = tl.load(row + 8).to(tl.pointer_type(tl.float32))
        p_ptr, g_ptr = tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16)
        m_ptr, v_ptr = tl.multiple_of(m_ptr, 16), tl.multiple_of(v_ptr, 16)
        start = (pid - tl.load(row + 6)) * CHUNK
        size = tl.minimum(tl.load(row + 5) - start, CHUNK).to(tl.int32)
        if SKIP:
            size = tl.where(tl.load(found_inf_ptr) != 0, 0, size)
        p_ptr, g_ptr, m_ptr, v_ptr = p_ptr + start, g_ptr + start, m_ptr + start, v_ptr + start
        ms_ptr, vs_ptr = ms_ptr + start // QB, vs_ptr + start // QB
        step = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32)))
        bc1 = 1.0 - _pow(beta1, step, INTERPRET)
        step_size = tl.math.div_rn(lr, bc1)
        bc2_sqrt = tl.sqrt_rn(1.0 - _pow(beta2, step, INTERPRET))
        # the random stream: a key from (job seed, step, tensor), hashed with the element's index
        seed = _hash_tl((base_seed + step.to(tl.int32) * 65537 + tensor * 7919).to(tl.uint32))
        full = size // BLOCK * BLOCK
        for off in range(0, full, BLOCK):
            _adamw_fp8_tile(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, off, start, size, seed, lr,
                            weight_decay, beta1, beta2, eps, step_size, bc2_sqrt, grad_coef, DECAY, SCALE,
                            STOCHASTIC, MASKED=False, QB=QB, ROWS=BLOCK // QB, INTERPRET=INTERPRET)
        if full < size:
            _adamw_fp8_tile(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, full, start, size, seed, lr,
                            weight_decay, beta1, beta2, eps, step_size, bc2_sqrt, grad_coef, DECAY, SCALE,
                            STOCHASTIC, MASKED=True, QB=QB, ROWS=BLOCK // QB, INTERPRET=INTERPRET)


class Fp8StateAdamW(TritonAdamW):
    """AdamW with both moments stored in e4m3 with block scales (the section above), for
    precision.optimizer_state: fp8. Constructed as TritonAdamW (fused=True); `seed` picks the stochastic
    rounding's random stream. On a GPU with Triton the step is `_adamw_fp8_kernel`; elsewhere
    `fp8_adamw_reference`, tensor by tensor.

    Its state_dict holds the decoded moments under AdamW's names and shapes, in the parameter's dtype
    (exact: e4m3 values and their squares fit bf16), so checkpoints look like any AdamW's, and
    load_state_dict encodes them again (to the same values when they came from this optimizer). DTensor
    parameters (FSDP2, TP, EP shards) keep plain e4m3 state for their local shard, its blocks over that
    shard; their state_dict gives the decoded moments as DTensors of the parameter's layout, so a checkpoint
    resumes under another layout as AdamW's does.
    `stochastic = False` rounds half up instead (tests compare the kernel with the reference that way)."""

    block = 1024  # elements per tile: 8 scale blocks of 128 (scripts/adamw_floor.py --fp8 --sweep: 1024
    num_warps = 4  # elements and 4 warps beat 2048 and 8 by 8% on an H100)
    tiles_by_gpu: dict[str, tuple[int, int]] = {}  # not swept on other GPUs

    def __init__(self, *args, seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.seed = int(seed)
        self.stochastic = True

    def _init_state(self, group: dict) -> None:
        for p in group["params"]:
            if p.grad is None or self.state[p]:
                continue
            # a DTensor's state covers this rank's shard, its blocks counted over the shard alone
            local = p.to_local() if isinstance(p, DTensor) else p
            blocks = -(-local.numel() // FP8_BLOCK)
            self.state[p].update(
                step=torch.zeros((), dtype=torch.float32, device=local.device),
                exp_avg=torch.zeros(local.shape, dtype=FP8_DTYPE, device=local.device),
                exp_avg_sq=torch.zeros(local.shape, dtype=FP8_DTYPE, device=local.device),
                exp_avg_scale=torch.ones(blocks, dtype=torch.float32, device=local.device),
                exp_avg_sq_scale=torch.ones(blocks, dtype=torch.float32, device=local.device),
            )

    def _local_shards(self, p, g, m, v) -> tuple | None:
        # the moments are this rank's plain e4m3 tensors already
        if not (isinstance(g, DTensor) and g.placements == p.placements and g.device_mesh == p.device_mesh):
            return None
        return p.to_local(), g.to_local(), m, v

    def _extra_state(self, state: dict) -> tuple[torch.Tensor, ...]:
        return state["exp_avg_scale"], state["exp_avg_sq_scale"]

    def _servable(self, p, g, m, v, s, ms, vs) -> bool:
        return (
            type(p) in _PLAIN and type(g) is torch.Tensor and p.is_cuda and p.dtype in _TL_DTYPES
            and g.dtype == p.dtype and m.dtype == v.dtype == FP8_DTYPE and s.dtype == torch.float32
            and ms.dtype == vs.dtype == torch.float32
            and p.device == g.device == m.device == v.device == s.device == ms.device == vs.device
            and all(t.is_contiguous() for t in (p, g, m, v, ms, vs))
            and g.shape == p.shape == m.shape == v.shape
            and ms.numel() == vs.numel() == -(-p.numel() // FP8_BLOCK)
        )

    def _launch(self, group, dtype, aligned, table, program_tensor, hyper, coef, skip, scale: bool,
                skip_on_inf: bool) -> None:
        _adamw_fp8_kernel[(program_tensor.numel(),)](
            table, program_tensor, hyper, coef, skip, self.seed % 2**31, DTYPE=_TL_DTYPES[dtype],
            DECAY=group["weight_decay"] != 0, SCALE=scale, SKIP=skip_on_inf, STOCHASTIC=self.stochastic,
            CHUNK=self.chunk, BLOCK=self.block, QB=FP8_BLOCK, ROW=table.shape[1], INTERPRET=_INTERPRET,
            num_warps=self.num_warps, enable_fp_fusion=True,
        )

    def _fallback_step(self, grad_coef: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """fp8_adamw_reference over every parameter with a gradient; the skip decided on the host."""
        if found_inf is not None and bool(found_inf):
            return
        index = 0
        for group in self.param_groups:
            self._init_state(group)
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                index += 1
                if param.grad is None:
                    continue
                p, grad = param.detach(), param.grad
                if isinstance(p, DTensor):  # this rank's shard (clipping and the skip were decided globally)
                    p, grad = p.to_local(), grad.to_local()
                g = grad if grad_coef is None else \
                    (grad.float() * grad_coef.to(grad.device, grad.dtype).float()).to(grad.dtype)
                state = self.state[param]
                state["step"] += 1
                step = int(state["step"])
                noise = 0.5
                if self.stochastic:
                    noise = (fp8_noise(p, self.seed, step, 2 * index),
                             fp8_noise(p, self.seed, step, 2 * index + 1))
                fp8_adamw_reference(p, g, state, lr=group["lr"], beta1=beta1, beta2=beta2,
                                    eps=group["eps"], weight_decay=group["weight_decay"], noise=noise)

    def state_dict(self) -> dict:
        """AdamW's state_dict: the decoded moments, in the parameter's dtype, under exp_avg / exp_avg_sq."""
        packed = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for index, state in list(packed["state"].items()):
            if "exp_avg_scale" not in state:
                continue
            param = params[index]
            m = fp8_decode(state["exp_avg"], state["exp_avg_scale"]).to(param.dtype)
            v = fp8_decode(state["exp_avg_sq"], state["exp_avg_sq_scale"]).square().to(param.dtype)
            if isinstance(param, DTensor):  # shards of the parameter's layout, as AdamW's state would be
                m, v = (DTensor.from_local(t, param.device_mesh, param.placements, run_check=False,
                                           shape=param.shape, stride=param.stride()) for t in (m, v))
            packed["state"][index] = {"step": state["step"], "exp_avg": m, "exp_avg_sq": v}
        return packed

    def load_state_dict(self, state_dict: dict) -> None:
        """Load an AdamW state_dict (this optimizer's, or any AdamW's), encoding the moments in e4m3."""
        super().load_state_dict(state_dict)
        self._tables.clear()
        for state in self.state.values():
            if "exp_avg" in state and state["exp_avg"].dtype != FP8_DTYPE:
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if isinstance(m, DTensor):
                    m, v = m.to_local(), v.to_local()
                m, v = m.float(), v.float()
                state["exp_avg"], state["exp_avg_scale"] = fp8_encode(m, 0.5)
                state["exp_avg_sq"], state["exp_avg_sq_scale"] = fp8_encode(v.sqrt(), 0.5)
