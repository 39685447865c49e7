"""The HF side, the baseline: transformers' own model (SDPA attention, loss computed by the model, fused
AdamW, bf16) on the same tokens as the mlite side; where this transformers cannot build the model, the
measured reference to compare with instead.
"""

from __future__ import annotations

from mlite.config.arch import ModelArch

# What the HF side is compared with where this transformers cannot build the model (measured on one H100
# with a transformers that can; docs/PERFORMANCE.md, "One GPU: DeepSeek-V4"): model_type -> the figures.
HF_ANCHORS = {
    "deepseek_v4": "transformers 5.23 on one H100: 7,790 tokens/s, 8.5% MFU, 68.2 GB at 4096; "
                   "8,945 tokens/s, 9.7% at 2048",
}
HF_CLASSES = {"deepseek_v4": "DeepseekV4ForCausalLM"}  # model types that not every transformers has


def _transformers_has(name: str) -> bool:
    import transformers

    return hasattr(transformers, name)


def hf_skip_reason(arch: ModelArch) -> str:
    """Why the HF side cannot run for `arch` with the installed transformers ('' when it can), with the
    measured reference to compare the mlite side with instead."""
    cls = HF_CLASSES.get(arch.model_type)
    if cls is None or _transformers_has(cls):
        return ""
    import transformers

    return (f"transformers {transformers.__version__} has no {arch.model_type}; "
            f"anchor: {HF_ANCHORS[arch.model_type]}")


def hf_step_fn(arch: ModelArch, sequences: list[list[int]], device: str, accum: int = 1):
    """The baseline: transformers' own model, SDPA attention, a right-padded batch (HF's usual way to train
    on sequences of mixed lengths), loss computed by the model, fused AdamW. DeepSeek-V4: eager attention
    (the only one transformers has for it), grouped_mm experts, and a balanced random hash table on the
    hash-routed layers (transformers initialises it to zeros: every token to expert 0), as the mlite side
    has."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mlite.runtime.ckpt.hf import hf_config_from_arch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    cfg = hf_config_from_arch(arch, dtype)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    kwargs = {"attn_implementation": "sdpa"}
    if arch.v4 is not None:
        kwargs = {"attn_implementation": "eager", "experts_implementation": "grouped_mm"}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    if arch.v4 is not None:
        from mlite.runtime.models.deepseek_v4 import balanced_hash_table

        table = balanced_hash_table(arch.vocab, arch.moe.num_experts, arch.moe.top_k)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(getattr(module, "tid2eid", None), torch.Tensor):
                    module.tid2eid.copy_(table)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.startswith("cuda"))
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)

    def step() -> None:
        for _ in range(accum):
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            (out.loss / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (model, opt), {}
