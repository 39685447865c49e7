"""The FLOPs of a training step and its MFU (model FLOPs utilisation), for a case's packed sequences.

MFU (PaLM's model FLOPs, arXiv:2204.02311 appendix B, attention halved for the causal mask; against the
GPU's dense bf16 peak):
    flops/token = 6 * (matmul params of the active path + LM head) + 6 * layers * (heads * head_dim) * s_eff
where s_eff = sum(len_i^2) / sum(len_i) over the packed sequences (causal attention costs ~len^2 / 2 per
sequence, forward + backward = 3x, 2 FLOPs per multiply-add). Only the top-k routed experts count for MoE.
DeepSeek-V4 attends over gathered key sets, not the causal square: its count is `v4_flops_per_token`.

Arithmetic only: no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from mlite.config.arch import V4_CSA, ModelArch
from mlite.config.catalog import layer_params


def matmul_params_per_token(arch: ModelArch) -> int:
    """Parameters every token multiplies through (the catalog's active count per layer) plus the LM head,
    which runs even when tied to the embedding. Norm weights ride along: under 0.1% of the total.
    DeepSeek-V4: the exact matmul count of `v4_matmul_params_per_token`."""
    if arch.v4 is not None:
        return v4_matmul_params_per_token(arch)
    return sum(layer_params(arch, i).active for i in range(arch.num_layers)) + arch.hidden * arch.vocab


def effective_seq_len(seq_lens: list[int]) -> float:
    return sum(n * n for n in seq_lens) / max(1, sum(seq_lens))


def flops_per_token(arch: ModelArch, seq_lens: list[int]) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward)."""
    if arch.v4 is not None:
        return 3 * v4_flops_per_token(arch, seq_lens)
    attention = 6 * arch.num_layers * arch.num_heads * arch.head_dim * effective_seq_len(seq_lens)
    return 6 * matmul_params_per_token(arch) + attention


def v4_matmul_params_per_token(arch: ModelArch) -> int:
    """DeepSeek-V4: the weights of every matmul one token runs through, per layer

        attention  h x q_lora + q_lora x heads x head_dim + h x head_dim          (q down, q up, shared K=V)
                   + heads x head_dim x o_lora + o_groups x o_lora x h           (grouped low-rank output)
          CSA/HCA  + 2 x h x width x head_dim                (compressor kv + gate; width 2 on CSA, else 1)
          CSA      + 2 x h x 2 x index_head_dim + q_lora x index_heads x index_head_dim + h x index_heads
                                                  (indexer compressor kv + gate, indexer q, head weights)
        MoE        3 x h x (shared_ffn + top_k x expert_ffn) + experts x h        (experts, router)
        mHC        2 x (2 + n) x n x (n x h)                  (fn matrices before attention and the MoE)

    plus the mHC head (n x n x h) and the LM head (h x vocab). Norms, sinks, biases and mHC bases/scales
    are not matmuls and are left out; the MTP block is not counted (the bench trains without it)."""
    v4, moe, h = arch.v4, arch.moe, arch.hidden
    heads, hd, n = arch.num_heads, arch.head_dim, v4.hc_mult
    total = 0
    for layer in range(arch.num_layers):
        ratio = v4.compress_ratios[layer]
        attn = h * v4.q_lora_rank + v4.q_lora_rank * heads * hd + h * hd
        attn += heads * hd * v4.o_lora_rank + v4.o_groups * v4.o_lora_rank * h
        if ratio:
            attn += 2 * h * (2 if ratio == V4_CSA else 1) * hd
        if ratio == V4_CSA:
            ihd, iheads = v4.index_head_dim, v4.index_n_heads
            attn += 2 * h * 2 * ihd + v4.q_lora_rank * iheads * ihd + h * iheads
        ffn = 3 * h * (moe.shared_expert_ffn + moe.top_k * moe.expert_ffn) + moe.num_experts * h
        mhc = 2 * (2 + n) * n * n * h
        total += attn + ffn + mhc
    return total + n * n * h + h * arch.vocab


def _mean_over_tokens(seq_lens: list[int], visible: Callable[[int], int]) -> float:
    """visible(p) averaged over every token of the packed batch, p its position in its sequence."""
    return sum(visible(p) for n in seq_lens for p in range(n)) / max(1, sum(seq_lens))


def v4_flops_per_token(arch: ModelArch, seq_lens: list[int]) -> float:
    """DeepSeek-V4 forward FLOPs per token (2 per multiply-add), exact for the packed `seq_lens`:

        2 x v4_matmul_params_per_token(arch)
        + sum over layers of 4 x heads x head_dim x K_layer            (attention core: scores and values)
        + sum over CSA layers of 2 x index_heads x index_head_dim x E  (the indexer scores every entry)

    K_layer is the number of keys a query at position p really sees, averaged over the batch's tokens:
    min(window, p + 1) sliding-window keys on every layer, plus on an HCA layer (ratio r) (p + 1) // r
    compressed entries, on a CSA layer (ratio 4) min(index_topk, (p + 1) // 4) of them (the indexer's
    pick); E = (p + 1) // 4, the CSA entries visible to the query, averaged the same way. Training is
    3 x this (`flops_per_token`)."""
    v4 = arch.v4
    window = _mean_over_tokens(seq_lens, lambda p: min(v4.sliding_window, p + 1))
    compressed = {}
    for ratio in set(v4.compress_ratios) - {0}:
        cap = v4.index_topk if ratio == V4_CSA else None
        compressed[ratio] = _mean_over_tokens(
            seq_lens, lambda p, r=ratio, c=cap: (p + 1) // r if c is None else min(c, (p + 1) // r))
    keys = sum(window + compressed.get(ratio, 0.0) for ratio in v4.compress_ratios)
    core = 4 * arch.num_heads * arch.head_dim * keys
    csa_layers = sum(1 for ratio in v4.compress_ratios if ratio == V4_CSA)
    indexer = 0.0
    if csa_layers:
        entries = _mean_over_tokens(seq_lens, lambda p: (p + 1) // V4_CSA)
        indexer = csa_layers * 2 * v4.index_n_heads * v4.index_head_dim * entries
    return 2 * v4_matmul_params_per_token(arch) + core + indexer


def mfu(arch: ModelArch, seq_lens: list[int], tokens_per_s: float, peak_tflops: float) -> float:
    return flops_per_token(arch, seq_lens) * tokens_per_s / (peak_tflops * 1e12)
