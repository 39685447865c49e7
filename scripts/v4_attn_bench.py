"""Time DeepSeek-V4's key-set attention core fwd+bwd on one GPU (bf16, V4-Flash shapes: 64 heads x 512,
window 128, one sequence), compiled as the model's blocks are, with and without the host's entry limits.

    python3 scripts/v4_attn_bench.py [--tokens 4096] [--out results.json]

Layers: sliding (no entries), CSA (T/4 entries, each query's top 512 of its visible ones), HCA (T/128).
Errors are relative to the same core run in fp32 on the same bf16 inputs."""

from __future__ import annotations

import argparse
import json

import torch

from mlite.bench import time_steps
from mlite.runtime.models.deepseek_v4 import block_limits, key_set_attention


def inputs(t: int, h: int, d: int, w: int, c: int, ratio: int, top_k: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, h, d, device="cuda", generator=g).bfloat16().requires_grad_()
    kv = torch.randn(t, d, device="cuda", generator=g).bfloat16().requires_grad_()
    sinks = torch.randn(h, device="cuda", generator=g).requires_grad_()
    tok = torch.arange(t, device="cuda")[:, None]
    key = (tok // w - 1) * w + torch.arange(2 * w, device="cuda")
    window_mask = (key <= tok) & (key > tok - w) & (key >= 0)
    entries = entry_mask = None
    if c:
        entries = torch.randn(c, d, device="cuda", generator=g).bfloat16().requires_grad_()
        visible = torch.arange(c, device="cuda")[None] < ((tok + 1) // ratio)
        score = torch.rand(t, c, device="cuda", generator=g).masked_fill(~visible, -1)
        picked = score.topk(min(top_k, c), dim=1).indices
        entry_mask = torch.zeros(t, c, dtype=torch.bool, device="cuda").scatter_(1, picked, True) & visible
    return q, kv, window_mask, entries, entry_mask, sinks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t, h, d, w = args.tokens, 64, 512, 128
    results = []
    for layer, c, ratio in (("sliding", 0, 1), ("csa", t // 4, 4), ("hca", t // 128, 128)):
        q, kv, wm, entries, em, sinks = inputs(t, h, d, w, c, ratio, 512)
        leaves = [x for x in (q, kv, entries, sinks) if x is not None]
        grad_out = torch.randn(t, h, d, device="cuda").bfloat16()

        def run(core, cast=None):
            for x in leaves:
                x.grad = None
            args_ = [q, kv, wm, entries, None, em, sinks, d**-0.5]
            if cast is not None:
                args_ = [a.detach().to(cast).requires_grad_() if torch.is_tensor(a) and a.is_floating_point()
                         else a for a in args_]
                out = core(*args_)
                out.backward(grad_out.to(cast))
                return [out.detach()] + [a.grad for a in args_ if torch.is_tensor(a) and a.grad is not None]
            out = core(*args_)
            out.backward(grad_out)
            return [out.detach()] + [x.grad.clone() for x in leaves]

        limits = block_limits([t], ratio, w, t) if c else None
        reference = run(key_set_attention, cast=torch.float32)
        cores = {"no limits": torch.compile(key_set_attention),
                 "limits": torch.compile(lambda *a: key_set_attention(*a, entry_limits=limits))}
        for name, core in cores.items():
            if name == "limits" and limits is None:
                continue
            row = {"layer": layer, "core": name}
            try:
                got = run(core)
                row["max_err"] = [float((a.float() - r.float()).abs().max() / r.float().abs().max())
                                  for a, r in zip(got, reference)]
                torch.cuda.reset_peak_memory_stats()
                timing = time_steps(lambda core=core: run(core), 3, 10, "cuda")
                row["ms"] = timing.median_ms
                row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            except Exception as e:  # noqa: BLE001 - a core that fails is a result too
                row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
