"""Can FlexAttention run DeepSeek-V4's sliding-window attention (64 query heads sharing one 512-wide K=V
head) on this GPU, and how fast against the block-bmm core? python scripts/flex_probe.py"""

from __future__ import annotations

import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.models.deepseek_v4 import batch_geometry, key_set_attention


def timed(fn, steps=5):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    t, h, d, w = 4096, 64, 512, 128
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sinks = torch.zeros(h, device="cuda")
    geo = batch_geometry(PackedBatch.from_sequences([[0] * t]).to("cuda"), w, [])

    def ours():
        key_set_attention(q, kv, geo.window_mask, None, None, None, sinks, d**-0.5).sum().backward()

    print(f"block-bmm core fwd+bwd: {timed(ours):.2f} ms")

    def window(b, hh, qi, ki):
        return (qi >= ki) & (qi - ki < w)

    mask = create_block_mask(window, 1, 1, t, t, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    for opts in (None, {"BLOCK_M": 64, "BLOCK_N": 64}, {"BLOCK_M": 32, "BLOCK_N": 32},
                 {"BLOCK_M": 16, "BLOCK_N": 32, "num_stages": 1}):
        def run():
            out, lse = flex(q.transpose(0, 1)[None], kv[None, None], kv[None, None], block_mask=mask,
                            enable_gqa=True, return_lse=True, scale=d**-0.5, kernel_options=opts)
            (out.sum() + lse.sum()).backward()
        try:
            print(f"flex {opts}: {timed(run):.2f} ms")
        except Exception as err:  # noqa: BLE001 - report and try the next options
            print(f"flex {opts}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
