"""Kernel-level A/B of the FP8 linear libraries at one decoder layer's widths (CUDA; one process).

Times forward + backward of decoder layers' linear work (`--layers` in a row), attention itself left out:

- attention projections: RMSNorm -> qkv -> (the q part) -> o_proj, plus the residual;
- MLP: RMSNorm -> gate_up -> SwiGLU -> down, plus the residual;

under each variant, all at the same widths and tokens, interleaved round by round so drift hits every
variant alike:

- bf16: torch RMSNorm + nn.Linear, torch.compile'd (mlite's bf16 path);
- ao-tensorwise / ao-rowwise: the same with torchao's Float8Linear (mlite's precision.fp8 today);
- te-bf16: Transformer Engine's fused modules (LayerNormLinear, Linear, LayerNormMLP) without FP8;
- te-current / te-delayed / te-block: those modules under TE's Float8CurrentScaling, DelayedScaling and
  Float8BlockScaling recipes (TE fuses the norm and the SwiGLU with the FP8 cast).

Needs Transformer Engine for the te-* variants (on the bare device machine: scripts/gpu_te_env.sh).
Default widths: Qwen3-1.7B at the dense bench case's 4096 tokens.

  python3 scripts/fp8_linear_ab.py [--hidden 2048 --ffn 6144 --heads 16 --kv-heads 8 --head-dim 128
                                    --tokens 4096 --layers 4 --rounds 5 --iters 20]
                                   [--variant bf16 --variant te-current ...] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import nn
from torch.nn import functional as F

VARIANTS = ("bf16", "ao-tensorwise", "ao-rowwise", "te-bf16", "te-current", "te-delayed", "te-block")


class TorchLayerLinears(nn.Module):
    """The linear work of one decoder layer, in plain torch (what mlite's models run)."""

    def __init__(self, hidden: int, ffn: int, q_width: int, kv_width: int):
        super().__init__()
        self.q_width = q_width
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, q_width + 2 * kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.qkv(self.attn_norm(x))[:, : self.q_width]
        x = x + self.o_proj(q.contiguous())
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TeLayerLinears(nn.Module):
    """The same work in Transformer Engine's fused modules (norm fused into the first GEMM's input cast)."""

    def __init__(self, hidden: int, ffn: int, q_width: int, kv_width: int):
        super().__init__()
        import transformer_engine.pytorch as te

        self.q_width = q_width
        kw = dict(bias=False, params_dtype=torch.bfloat16)
        self.qkv = te.LayerNormLinear(hidden, q_width + 2 * kv_width, eps=1e-6, normalization="RMSNorm", **kw)
        self.o_proj = te.Linear(q_width, hidden, **kw)
        self.mlp = te.LayerNormMLP(hidden, ffn, eps=1e-6, normalization="RMSNorm", activation="swiglu", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.qkv(x)[:, : self.q_width]
        x = x + self.o_proj(q.contiguous())
        return x + self.mlp(x)


def te_recipe(variant: str):
    from transformer_engine.common import recipe

    return {"te-current": recipe.Float8CurrentScaling, "te-delayed": recipe.DelayedScaling,
            "te-block": recipe.Float8BlockScaling}[variant]()


def build(variant: str, args) -> tuple[nn.Module, object]:
    """The module of `variant` (`args.layers` layers in a row) and the context each step runs under."""
    import contextlib

    q_width, kv_width = args.heads * args.head_dim, args.kv_heads * args.head_dim
    if variant.startswith("te-"):
        import transformer_engine.pytorch as te

        module = nn.Sequential(*(TeLayerLinears(args.hidden, args.ffn, q_width, kv_width)
                                 for _ in range(args.layers))).cuda()
        if variant == "te-bf16":
            return module, contextlib.nullcontext
        recipe = te_recipe(variant)
        return module, lambda: te.autocast(enabled=True, recipe=recipe)
    module = nn.Sequential(*(TorchLayerLinears(args.hidden, args.ffn, q_width, kv_width)
                             for _ in range(args.layers))).cuda().to(torch.bfloat16)
    if variant.startswith("ao-"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(variant[3:]))
    return torch.compile(module), contextlib.nullcontext


def time_variant(module: nn.Module, context, x: torch.Tensor, grad: torch.Tensor, iters: int) -> float:
    """Milliseconds of one forward + backward, the mean of `iters` issued back to back (the host runs
    ahead of the GPU as in training, so launch costs count only where the host cannot keep up)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        with context():
            out = module(x)
        out.backward(grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("hidden", 2048), ("ffn", 6144), ("heads", 16), ("kv-heads", 8), ("head-dim", 128),
                          ("tokens", 4096), ("layers", 4), ("rounds", 5), ("iters", 20)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--variant", action="append", choices=VARIANTS, help="default: every variant")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    variants, failed = {}, {}
    for variant in args.variant or VARIANTS:
        try:
            module, context = build(variant, args)
            time_variant(module, context, x, grad, 5)  # compile, autotune, TE's first-call set-up
            variants[variant] = (module, context)
        except Exception as error:  # a library missing or refusing the shapes: report it, time the rest
            failed[variant] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            print(f"{variant}: cannot run: {failed[variant]}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (module, context) in variants.items():
            times[name].append(time_variant(module, context, x, grad, args.iters))
    base = statistics.median(times["bf16"]) if "bf16" in times else None
    # forward and backward (x3) of every linear: q, k, v and o (2 (heads + kv_heads) head_dim wide in all),
    # gate, up and down (3 ffn)
    widths = 2 * (args.heads + args.kv_heads) * args.head_dim + 3 * args.ffn
    flops = 6 * args.layers * args.tokens * args.hidden * widths
    results = {}
    for name, samples in times.items():
        ms = statistics.median(samples)
        results[name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                         "vs_bf16": round(base / ms, 3) if base else None,
                         "spread": round((max(samples) - min(samples)) / ms, 3)}
        print(f"{name:>14}: {ms:7.3f} ms  {results[name]['tflops']:6.1f} TFLOP/s  "
              f"x{results[name]['vs_bf16']}  (spread {results[name]['spread']})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results, "failed": failed,
                       "torch": torch.__version__, "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
