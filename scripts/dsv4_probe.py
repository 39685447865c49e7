"""Time one DeepSeek-V4 training step on a GPU at V4-Flash widths (4 layers: sliding, CSA, HCA, CSA; 32
experts top-6) and print where the time goes (torch.profiler, top CUDA ops). Usage:
python scripts/dsv4_probe.py [seq_len] [--profile] [--recompute] [--compile]"""

from __future__ import annotations

import sys
import time

import torch

from mlite.config.arch import arch_from_hf_config
from mlite.config.catalog import PRESETS
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.models import build_model


def main() -> None:
    seq = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 4096
    cfg = dict(PRESETS["deepseek-v4-flash"], num_hidden_layers=4, compress_ratios=[0, 4, 128, 4],
               n_routed_experts=32, num_hash_layers=1)
    arch = arch_from_hf_config(cfg, name="dsv4-flash-4l")
    torch.manual_seed(0)
    model = build_model(arch, dtype=torch.bfloat16, device="cuda")
    if "--recompute" in sys.argv or "--compile" in sys.argv:
        from mlite.runtime.parallel.parallelize import apply_recompute

        full = "--recompute" in sys.argv
        apply_recompute(model, "full" if full else "none", "uniform" if full else None, 1,
                        compile_blocks="--compile" in sys.argv)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, arch.vocab, (seq,)).tolist()
    batch = PackedBatch.from_sequences([ids]).to("cuda")

    def step():
        out = model(batch)
        logits = model.compute_logits(out.hidden).float()
        loss = torch.nn.functional.cross_entropy(logits[:-1], batch.input_ids[1:]) + out.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    steps = 4
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - start) / steps
    print(f"seq {seq}: {dt * 1e3:.1f} ms/step, {seq / dt:,.0f} tokens/s, "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if "--profile" in sys.argv:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            step()
            torch.cuda.synchronize()
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))


if __name__ == "__main__":
    main()
