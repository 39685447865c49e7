"""What the vLLM rollout relies on of vLLM's DeepSeek-V4 code, in one place. Checked against vLLM 0.25.1
(`VLLM_CHECKED`). Paths are under vllm/ of its wheel: bare ones under models/deepseek_v4/, `quantization/`
for model_executor/layers/quantization/, `reload/` for model_executor/model_loader/reload/. Only vLLM's
public names are used; vllm is imported inside the functions, never at module import.

- **FP8 where vLLM insists.** Without a quantization config every V4 linear is plain bf16, but the output
  projection's first half `wo_a` is always multiplied by DeepGEMM's fp8_einsum with `(wo_a.weight,
  wo_a.weight_scale_inv)` (nvidia/ops/o_proj.py:63-67), which only a block-FP8 linear has. Two ways give it
  one.
  At the sync (`v4_fp8_at_sync_config`): config.json carries a block-FP8 `quantization_config`
  (DeepseekV4FP8Config over Fp8Config, quant_config.py:121-132) whose `ignored_layers` name every other
  quantisable layer by its exact vLLM prefix (whole-prefix match, quantization/utils/quant_utils.py:510-572),
  so only wo_a is built FP8 (quantization/fp8.py:352-379) and the weight sync sends it quantised
  (mlite.runtime.ckpt.sync.vllm_fp8_weight); `expert_dtype: "fp8"` makes its scale float32
  (quant_config.py:80-84, quantization/fp8.py:376), and the routed experts stay unquantised (ignored,
  quant_config.py:134-141).
  Online (`v4_online_fp8_engine_args`): vLLM's `quantization="online"` with `{"linear": "fp8_per_block"}`
  (config/quantization.py:119-122, quantization/online/fp8.py:204-266), every linear but wo_a ignored by a
  regex (quantization/online/base.py:145-160, quantization/compressed_tensors/utils.py:50-102 and 175-193);
  the sync sends wo_a in bf16 and vLLM quantises it on every reload (reload/layerwise.py:344-362).
- **The attention sinks after a reload.** `reload_weights` (v1/worker/gpu_model_runner.py:5487-5489) moves
  every layer's parameters to meta (reload/layerwise.py:103-117, reload/meta.py:115-133) and wraps their
  weight loaders; V4's `load_weights` copies the sinks straight into the meta parameter
  (nvidia/model.py:1220-1226, its params_dict taken after the move, :1142) instead of calling a loader, so
  the attention module counts nothing loaded and gets its old tensors back (reload/layerwise.py:255-265):
  the dummy values of the first load, or whatever a level-2 sleep left. `set_attention_sinks` copies them
  again once the reload is done, by name, the way that loader cuts them (nvidia/model.py:1146-1151).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial

import torch

from mlite.errors import MliteError

VLLM_CHECKED = "0.25.1"

# the quantisable layers of one V4 decoder layer other than wo_a, by vLLM module name (attention.py:203-238
# and 700-706: wq_a and wkv fused, wq_b, wo_b, the indexer's wq_b; nvidia/model.py:108-123 and 589-598: the
# shared experts' gate_up_proj and down_proj; :672-690 the routed experts); the compressors, the indexer's
# weights_proj and the router are built without a quantization config
_OTHER_QUANTISABLE = ("attn.fused_wqa_wkv", "attn.wq_b", "attn.wo_b", "attn.indexer.wq_b",
                      "ffn.shared_experts.gate_up_proj", "ffn.shared_experts.down_proj", "ffn.experts")
_WO_A_ONLY = r"re:^(?!.*\.attn\.wo_a$)"  # online: ignore every linear but the attention's wo_a
# the transformers form of V4's layer layout, which vLLM never reads (it reads compress_ratios and
# num_hash_layers): transformers 5.17's PretrainedConfig validates mlp_layer_types against ("sparse", "dense")
# and refuses ours when vLLM builds its config (transformers_utils/configs/deepseek_v4.py:23)
V4_TRANSFORMERS_ONLY = ("layer_types", "mlp_layer_types", "compress_rates")
_SINK = ".attn.attn_sink"


def v4_fp8_at_sync_config(config: dict, num_layers: int, linears: bool = False) -> dict:
    """The config.json vLLM builds DeepSeek-V4 from when the sync sends wo_a as FP8: `config` with a block-FP8
    quantization_config that leaves every layer but wo_a unquantised, and float32 scales. `linears`: the
    sync sends every quantisable layer in FP8, the routed experts too (DeepSeek's release form with FP8
    experts), so nothing is ignored."""
    ignored = [] if linears else [f"model.layers.{i}.{module}" for i in range(num_layers)
                                  for module in _OTHER_QUANTISABLE]
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128], "ignored_layers": ignored}
    return dict(config) | {"quantization_config": quant, "expert_dtype": "fp8"}


def v4_online_fp8_engine_args() -> dict:
    """The LLM(...) arguments with which vLLM quantises DeepSeek-V4's wo_a itself (128x128 blocks, on every
    load and reload) and nothing else."""
    return {"quantization": "online",
            "quantization_config": {"linear": "fp8_per_block", "ignore": [_WO_A_ONLY]}}


def keep_attention_sinks(weights: Iterable[tuple[str, torch.Tensor]], into: dict[str, torch.Tensor]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """The weight stream unchanged, each attention sink of the main layers kept in `into` on its way (vLLM
    skips the MTP layers' `mtp.*`, nvidia/model.py:1440)."""
    for name, tensor in weights:
        if name.endswith(_SINK) and not name.startswith("mtp."):
            into[name] = tensor
        yield name, tensor


@torch.no_grad()
def set_attention_sinks(model: torch.nn.Module, sinks: dict[str, torch.Tensor], tp_rank: int | None = None,
                        tp_size: int | None = None) -> list[str]:
    """Inside the worker, on vLLM's model (after `reload_weights`): each sink (HF name -> [heads], whole)
    into the model's sink parameter of that name, in place: this tensor-parallel rank's heads into its first
    slots, as V4's loader does (nvidia/model.py:1146-1151, 1220-1226; the rest is padding). Names map through
    the model's `hf_to_vllm_mapper` (nvidia/model.py:1301). Returns the vLLM names set."""
    if tp_rank is None or tp_size is None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    params = dict(model.named_parameters())
    done = []
    for name, sink in sinks.items():
        target = mapper.apply_list([name]) if mapper is not None else [name]
        param = params.get(target[0]) if target else None
        if param is None:
            continue  # not on this engine rank (a pipeline stage's)
        heads = sink.shape[0] // tp_size
        param[:heads].copy_(sink[tp_rank * heads:(tp_rank + 1) * heads])
        done.append(target[0])
    return done


def resend_attention_sinks(llm, sinks: dict[str, torch.Tensor], tp_rank: int | None = None,
                           tp_size: int | None = None) -> None:
    """After `reload_weights`: the sinks into every worker's model (LLM.apply_model,
    entrypoints/llm.py:603-614), refused if a worker found none of them (vLLM renamed its sink parameter).
    `tp_rank`, `tp_size`: the worker's (default: read from vLLM inside the worker)."""
    if not sinks:
        return
    done = llm.apply_model(partial(set_attention_sinks, sinks=sinks, tp_rank=tp_rank, tp_size=tp_size))
    if any(len(names) == 0 for names in done):
        raise MliteError(
            f"vLLM's DeepSeek-V4 model has none of the attention sink parameters {sorted(sinks)[:2]}...; "
            f"mlite/trainers/grpo/vllm_adapter.py was checked against vLLM {VLLM_CHECKED}: update it to the "
            "installed vLLM"
        )
