"""DeepSeek-V4's weight stream to vLLM 0.25.1 (mlite.runtime.ckpt.sync.tp_group_weights with `v4_fp8`,
mlite.trainers.grpo.vllm_adapter), on the CPU.

What vLLM expects, read from its wheel (paths under vllm/models/deepseek_v4/ unless they say otherwise):

- float32 parameters: the mHC mixers hc_{attn,ffn}_{fn,base,scale} of every layer (nvidia/model.py:823-861)
  and hc_head_{fn,base,scale} (nvidia/model.py:1004-1022), the sinks attn_sink (attention.py:198-201), the
  compressors' ape (compressor.py:216-224; an attention compressor where compress_ratio > 1, an indexer and
  its compressor where it is 4: attention.py:187-188, 252-261, 312-314, 742), the correction bias of every
  non-hash layer, `ffn.gate.bias` -> e_score_correction_bias (nvidia/model.py:563, 578-582, 1311). The
  expectation below is written from that list, not from mlite's rule, and checked against the stream.
- wo_a in FP8: float8_e4m3fn [out, in] and a float32 `weight_scale_inv` [ceil(out/128), ceil(in/128)]
  (model_executor/layers/quantization/utils/fp8_utils.py:1246-1295), sent as `X.scale` (mapped at
  nvidia/model.py:1290-1297); DeepGEMM multiplies them (nvidia/ops/o_proj.py:63-67).
- the reload: `reload_weights` moves every module's own parameters to meta and wraps their loaders
  (model_executor/model_loader/reload/layerwise.py:103-117, meta.py:115-133), processes a module once its
  loaders saw all its elements and copies the result into the old tensors (layerwise.py:216-218, 331-369),
  and gives a module that loaded nothing its old tensors back (layerwise.py:255-265). V4 copies the sinks
  straight into the (meta) parameter (nvidia/model.py:1220-1226), so they are lost. `ReloadingConsumer`
  does exactly that, with real tensors.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from mlite.config import job_from_dict
from mlite.config.catalog import PRESETS
from mlite.errors import MliteError
from mlite.runtime.ckpt import sync
from mlite.runtime.ckpt.quant import FP8_MAX, dequantize, quantize_fp8_blocks
from mlite.trainers.grpo import vllm_adapter

DTYPE = torch.bfloat16  # the rollout's
CONFIG = PRESETS["tiny-deepseek-v4"]
SEED = 5


def job(root: Path | None = None, layout: dict | None = None) -> dict:
    model = {"path": str(root), "load_weights": False} if root else {"name": "tiny-deepseek-v4"}
    return {"model": {**model, "mtp_loss_weight": 0.3}, "parallel": layout or {}, "data": {"seq_len": 64},
            "cluster": {"gpu": "cpu"}, "precision": {"compute": "fp32"},
            "trainer": {"device": "cpu", "seed": SEED}}


def vllm_fp32_names(arch) -> set[str]:
    """The HF names of the parameters vLLM 0.25.1 creates in float32 for this DeepSeek-V4 (the main model:
    vLLM skips `mtp.*`, nvidia/model.py:1440)."""
    v4 = arch.v4
    names = {"hc_head_fn", "hc_head_base", "hc_head_scale"}
    for i, ratio in enumerate(v4.compress_ratios):
        names |= {f"layers.{i}.hc_{part}_{kind}" for part in ("attn", "ffn")
                  for kind in ("fn", "base", "scale")}
        names.add(f"layers.{i}.attn.attn_sink")
        if ratio > 1:
            names.add(f"layers.{i}.attn.compressor.ape")
        if ratio == 4:
            names.add(f"layers.{i}.attn.indexer.compressor.ape")
        if i >= v4.num_hash_layers:
            names.add(f"layers.{i}.ffn.gate.bias")
    return names


def fp8_bound(reference: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest |error| of rounding to e4m3 under a block scale, per element: half a unit in the last place
    (3 mantissa bits: 2**-4 of the value) for normal values, half the subnormal step (2**-10) times the scale
    below e4m3's smallest normal (2**-6)."""
    rows, cols = reference.shape
    full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return torch.maximum(reference.abs() * 2.0**-4, full * 2.0**-10)


# ------------------------------------------------------------------------------------------- the quantiser
def _round_trip(w: torch.Tensor):
    q, s = quantize_fp8_blocks(w, (128, 128), scale_dtype=torch.float32)
    rows, cols = w.shape
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == (math.ceil(rows / 128), math.ceil(cols / 128))
    mantissa, _ = torch.frexp(s)
    assert bool((mantissa == 0.5).all()), "every scale is a power of two"
    back = dequantize(q, s, block=(128, 128))
    assert bool(((back - w).abs() <= fp8_bound(w, s)).all())
    return q, s, back


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (1, 1), (130, 257), (127, 129), (300, 64)])
def test_fp8_round_trip_of_random_weights_is_within_e4m3s_rounding(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * 0.02
    _, s, _ = _round_trip(w)
    # the smallest power of two that fits each block's largest magnitude into e4m3
    blocks = [[w[i:i + 128, j:j + 128].abs().max() for j in range(0, shape[1], 128)]
              for i in range(0, shape[0], 128)]
    amax = torch.tensor(blocks)
    assert bool((amax / s <= FP8_MAX).all()) and bool((amax / (s / 2) > FP8_MAX).all())


def test_fp8_round_trip_of_structured_weights():
    # magnitudes 1e-3 .. 1e3 in different blocks, a zero block, values e4m3 holds exactly, a rank-one matrix
    w = torch.zeros(260, 300)
    w[:128, :128] = torch.linspace(-1e-3, 1e-3, 128 * 128).view(128, 128)
    w[:128, 128:256] = torch.linspace(-1e3, 1e3, 128 * 128).view(128, 128)
    exact = torch.tensor([0.0, 0.5, -1.0, 1.75, 448.0, -240.0, 2.0**-6, -(2.0**-9)])
    w[128:256, :128] = exact.repeat(128 * 16)[: 128 * 128].view(128, 128) * 2.0**-3
    w[256:, :] = torch.outer(torch.arange(1.0, 5.0), torch.linspace(-2, 2, 300))
    q, s, back = _round_trip(w)
    assert bool((back[:128, 256:] == 0).all()) and s[0, 2] == 1  # the all-zero block: zeros, scale 1
    assert torch.equal(back[128:256, :128], w[128:256, :128]), "values e4m3 holds come back exactly"
    assert s[0, 1] == 4.0 and s[0, 0] == 2.0**-18  # 1e3 / 448 -> 4; 1e-3 / 448 -> 2**-18


def test_block_boundaries_of_a_shape_not_a_multiple_of_128():
    """Each 128x128 block has its own scale, the last ones partial: one large value per block, at a block's
    last row and column or its first, sets that block's scale and no other."""
    rows, cols = 130, 257
    w = torch.full((rows, cols), 1e-2)
    corners = {(0, 0): (127, 127), (0, 1): (0, 128), (0, 2): (127, 256), (1, 0): (128, 127),
               (1, 1): (129, 255), (1, 2): (128, 256)}
    for k, (block, (r, c)) in enumerate(corners.items()):
        w[r, c] = 2.0 ** (k + 1) * 448
    q, s, back = _round_trip(w)
    for k, block in enumerate(corners):
        assert s[block] == 2.0 ** (k + 1), block
    assert torch.equal(back[127, 127], w[127, 127]) and torch.equal(back[128, 256], w[128, 256])


def test_the_quantiser_refuses_other_scale_dtypes_and_non_finite_weights():
    with pytest.raises(ValueError, match="ue8m0 scales"):
        quantize_fp8_blocks(torch.ones(4, 4), scale_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="inf or NaN"):
        sync.vllm_fp8_weight("layers.0.attn.wo_a.weight", torch.full((4, 4), float("nan")))
    # without scale_dtype: the released checkpoints' ue8m0 (unchanged)
    _, scale = quantize_fp8_blocks(torch.ones(4, 4))
    assert scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))


def test_the_rule_names_what_vllm_keeps_in_fp32_and_multiplies_in_fp8():
    fp32 = ["layers.3.hc_attn_fn", "layers.0.hc_ffn_scale", "hc_head_base", "layers.1.attn.attn_sink",
            "layers.1.attn.compressor.ape", "layers.1.attn.indexer.compressor.ape", "layers.2.ffn.gate.bias"]
    other = ["layers.1.ffn.gate.weight", "layers.0.ffn.gate.tid2eid", "layers.1.attn.compressor.wkv.weight",
             "layers.1.attn.wo_b.weight", "embed.weight", "head.weight", "layers.1.attn.kv_norm.weight",
             "layers.1.ffn.experts.3.w1.weight", "layers.1.attn.wo_a.scale"]
    assert all(sync.vllm_send_as(n, v4) == "fp32" for n in fp32 for v4 in ("wo_a", "online", "linears"))
    assert all(sync.vllm_send_as(n, "wo_a") == "rollout" for n in other)
    assert sync.vllm_send_as("layers.1.attn.wo_a.weight", "wo_a") == "fp8"
    assert sync.vllm_send_as("layers.1.attn.wo_a.weight", "online") == "rollout"
    assert all(sync.vllm_send_as(n, None) == "rollout" for n in [*fp32, "layers.1.attn.wo_a.weight"])
    assert sync.vllm_split_dim("layers.1.attn.wo_a.weight") is None  # quantised whole, on every rank
    # rollout.fp8_weights: every linear DeepSeek's release keeps in FP8, and the routed experts
    linears = ["layers.1.attn.wq_a.weight", "layers.1.attn.wq_b.weight", "layers.1.attn.wkv.weight",
               "layers.1.attn.wo_a.weight", "layers.1.attn.wo_b.weight", "layers.1.attn.indexer.wq_b.weight",
               "layers.1.ffn.shared_experts.w2.weight", "layers.1.ffn.experts.3.w1.weight",
               "mtp.0.ffn.experts.0.w3.weight"]
    kept = ["layers.1.attn.compressor.wkv.weight", "layers.1.attn.indexer.compressor.wkv.weight",
            "layers.1.attn.indexer.weights_proj.weight", "layers.1.ffn.gate.weight", "embed.weight",
            "head.weight", "layers.1.attn.kv_norm.weight", "layers.0.ffn.gate.tid2eid"]
    assert all(sync.vllm_send_as(n, "linears") == "fp8" for n in linears)
    assert all(sync.vllm_send_as(n, "linears") == "rollout" for n in kept)


# ------------------------------------------------------------------------------------ one process
@pytest.fixture(scope="module")
def one():
    """The tiny DeepSeek-V4 on one process: the runtime, its HF tensors as the trainer holds them (fp32), and
    the stream to a one-GPU vLLM engine with wo_a quantised at the sync."""
    from mlite.runtime.engine import Runtime

    rt = Runtime(job_from_dict(job()))
    trainer = dict(rt.export_weights(None))
    stats: dict = {}
    stream = list(sync.tp_group_weights(rt.held_models(), DTYPE, 1, rt.arch.num_kv_heads, stats,
                                        v4_fp8="wo_a"))
    return rt, trainer, stream, stats


def test_the_stream_sends_vllms_fp32_parameters_unrounded_and_the_rest_in_the_rollout_dtype(one):
    rt, trainer, stream, stats = one
    got = dict(stream)
    assert len(got) == len(stream) == len(trainer) + sum(sync.vllm_wants_fp8(n) for n in trainer)
    expected = vllm_fp32_names(rt.arch)
    main = {n for n in trainer if not n.startswith("mtp.")}
    assert {n for n in main if got[n].dtype == torch.float32} == expected
    for name in main:
        want = trainer[name]
        if name in expected:  # bit for bit the trainer's
            assert want.dtype == torch.float32 and torch.equal(got[name], want), name
        elif sync.vllm_wants_fp8(name):
            continue
        elif want.is_floating_point():
            assert got[name].dtype == DTYPE and torch.equal(got[name], want.to(DTYPE)), name
        else:  # the hash tables: as they are
            assert torch.equal(got[name], want), name
    assert stats["tensors"] == len(stream)
    assert stats["bytes"] == sum(t.numel() * t.element_size() for _, t in stream)


def test_the_stream_carries_wo_a_as_fp8_and_its_scales(one):
    rt, trainer, stream, _ = one
    got = dict(stream)
    wo_a = [n for n in trainer if n.endswith("attn.wo_a.weight")]
    assert len(wo_a) == rt.arch.num_layers + 1  # and the MTP layer's, which vLLM skips
    for name in wo_a:
        weight, scale = got[name], got[name.removesuffix(".weight") + ".scale"]
        rows, cols = trainer[name].shape
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == (rows, cols)
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (-(-rows // 128), -(-cols // 128))
        back = dequantize(weight, scale, block=(128, 128))
        assert bool(((back - trainer[name]).abs() <= fp8_bound(trainer[name], scale)).all()), name
    names = [n for n, _ in stream]  # each scale right after its weight (one layer's loads stay together)
    assert all(names[names.index(n) + 1] == n.removesuffix(".weight") + ".scale" for n in wo_a)


def test_without_v4_fp8_at_sync_wo_a_goes_in_the_rollout_dtype_and_fp32_stays(one):
    rt, trainer, _, _ = one
    stream = dict(sync.tp_group_weights(rt.held_models(), DTYPE, 1, rt.arch.num_kv_heads,
                                        v4_fp8="online"))
    assert sorted(stream) == sorted(trainer)
    for name, tensor in stream.items():
        if name in vllm_fp32_names(rt.arch):
            assert torch.equal(tensor, trainer[name])
        elif "wo_a" in name:
            assert tensor.dtype == DTYPE and torch.equal(tensor, trainer[name].to(DTYPE))
    # and for another model nothing changes: every float in the rollout dtype (tests/test_weight_sync.py)
    plain = dict(sync.tp_group_weights(rt.held_models(), DTYPE, 1, rt.arch.num_kv_heads))
    assert all(t.dtype == DTYPE for t in plain.values() if t.is_floating_point())


def test_the_runtime_streams_deepseek_v4_with_vllms_dtypes(one):
    """What VLLMRollout.load_weights streams (Runtime.tp_group_weights with v4_fp8): the runtime's
    layout through the sync's rule; without the key, every float in the rollout dtype."""
    rt, _, stream, stats = one
    mine: dict = {}
    got = list(rt.tp_group_weights(DTYPE, 1, mine, False, "wo_a"))
    assert [n for n, _ in got] == [n for n, _ in stream] and mine == stats
    assert all(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
               for (_, a), (_, b) in zip(got, stream))
    plain = list(rt.tp_group_weights(DTYPE, 1, {}, False, None))
    assert all(t.dtype == DTYPE for _, t in plain if t.is_floating_point())


def test_the_engine_config_asks_vllm_for_fp8_where_the_sync_sends_it(one, tmp_path):
    """rollout.v4_fp8_at_sync true: a block-FP8 quantization_config that quantises wo_a and nothing else,
    with float32 scales; false: no quantization_config, and vLLM's online fp8_per_block on wo_a only."""
    from mlite.trainers.grpo.vllm_rollout import write_engine_config

    rt = one[0]
    wanted = {f"model.layers.{i}.attn.wo_a" for i in range(rt.arch.num_layers)}
    others = {f"model.layers.{i}.{m}" for i in range(rt.arch.num_layers) for m in (
        "attn.fused_wqa_wkv", "attn.wq_b", "attn.wo_b", "attn.indexer.wq_b",
        "ffn.shared_experts.gate_up_proj", "ffn.shared_experts.down_proj", "ffn.experts")}

    assert write_engine_config(tmp_path / "config.json", rt, DTYPE, "wo_a") == {}
    config = json.loads((tmp_path / "config.json").read_text())
    # the release form vLLM reads, without the transformers form newer transformers refuses there
    assert not {"layer_types", "mlp_layer_types", "compress_rates"} & set(config)
    assert config["compress_ratios"][:4] == list(rt.arch.v4.compress_ratios) and config["num_hash_layers"]
    quant = config["quantization_config"]
    assert config["model_type"] == "deepseek_v4" and config["expert_dtype"] == "fp8"  # float32 scales
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    assert quant["activation_scheme"] == "dynamic"
    assert set(quant["ignored_layers"]) == others and not wanted & set(quant["ignored_layers"])

    args = write_engine_config(tmp_path / "config.json", rt, DTYPE, "online")
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert args["quantization"] == "online" and args["quantization_config"]["linear"] == "fp8_per_block"
    # vLLM's regex ignore (re.match of the pattern after "re:", compressed_tensors/utils.py:184-187)
    ignore = [p.removeprefix("re:") for p in args["quantization_config"]["ignore"]]
    assert not any(re.match(p, name) for p in ignore for name in wanted)
    assert all(any(re.match(p, name) for p in ignore) for name in others)

    assert write_engine_config(tmp_path / "config.json", rt, DTYPE, None) == {}
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())


# -------------------------------------------------------------------- a consumer that reloads as vLLM does
def vllm_name(name: str) -> str | None:
    """DeepSeek-V4's release name -> vLLM's (nvidia/model.py:1285-1315, the fp8-expert mapper); None: skipped
    (`mtp.*`, nvidia/model.py:1440)."""
    if name.startswith("mtp."):
        return None
    name = re.sub(r"\.scale$", ".weight_scale_inv", name)
    name = name.replace(".shared_experts.w2", ".shared_experts.down_proj", 1)
    for old, new in (("layers.", "model.layers."), ("embed.", "model.embed."), ("norm.", "model.norm."),
                     ("hc_head", "model.hc_head")):
        if name.startswith(old):
            name = new + name[len(old):]
    for old, new in (("head.weight", "lm_head.weight"), ("embed.weight", "embed_tokens.weight"),
                     (".ffn.gate.bias", ".ffn.gate.e_score_correction_bias")):
        if name.endswith(old):
            name = name[: -len(old)] + new
    return name


class Mapper:
    def apply_list(self, names: list[str]) -> list[str]:
        return [m for n in names if (m := vllm_name(n)) is not None]


SKIP = {"e_score_correction_bias"}  # never moved to meta (reload/meta.py:25-32)


def strict_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """vLLM's default_weight_loader (a copy_), refusing a dtype or shape the parameter does not have."""
    assert loaded.dtype == param.dtype and loaded.shape == param.shape, (loaded.dtype, param.dtype)
    param.data.copy_(loaded)


class ReloadingConsumer(nn.Module):
    """vLLM 0.25.1's DeepSeek-V4 as its weight reload sees it, one engine rank of `tp`: a parameter per HF
    tensor under vLLM's name and in vLLM's dtype (float32 where vLLM creates float32, FP8 wo_a with float32
    scales, bf16 otherwise; the fusing of q/kv and gate/up is left out, it touches neither), the sinks padded
    to `padded` heads. `load_weights` is V4's (the sinks copied straight into the parameter, the rest through
    each parameter's loader); `reload_weights` is the layerwise reload."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], tp_rank=0, tp=1, padded=8):
        super().__init__()
        self.tp_rank, self.tp = tp_rank, tp
        self.hf_to_vllm_mapper = Mapper()
        for name, (shape, dtype) in shapes.items():
            path, _, leaf = name.rpartition(".")
            module = self
            for part in path.split("."):
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            if leaf == "attn_sink":  # attention.py:198-201: padded, -inf
                shape = (padded,)
            data = torch.full(shape, -math.inf) if leaf == "attn_sink" else torch.empty(shape, dtype=dtype)
            module.register_parameter(leaf, nn.Parameter(data, requires_grad=False))
        self.dummy_load()

    def dummy_load(self) -> None:
        """load_format=dummy: every float uniform in [-1e-3, 1e-3] (weight_utils.py:1265-1285)."""
        g = torch.Generator().manual_seed(1234)
        for p in self.parameters():
            if p.is_floating_point():
                p.data.copy_(torch.rand(p.shape, generator=g).mul(2e-3).sub(1e-3))

    def sleep_level_2_and_wake(self, garbage: float = 7.0) -> None:
        """sleep(level=2) drops the weights; the woken memory holds whatever it holds."""
        for p in self.parameters():
            p.data.fill_(garbage if p.is_floating_point() else 0)

    def load_weights(self, weights) -> None:  # nvidia/model.py:1132-1237, as far as the sinks go
        params = dict(self.named_parameters())  # taken after the reload moved them (nvidia/model.py:1142)
        heads_per_rank = None
        for hf_name, loaded in weights:
            name = vllm_name(hf_name)
            if name is None:
                continue
            if "attn_sink" in name:  # nvidia/model.py:1220-1226
                heads_per_rank = loaded.shape[0] // self.tp
                narrow = loaded[self.tp_rank * heads_per_rank:(self.tp_rank + 1) * heads_per_rank]
                params[name][: narrow.shape[0]].copy_(narrow)
                continue
            param = params[name]
            getattr(param, "weight_loader", strict_loader)(param, loaded)

    def reload_weights(self, weights_iterator) -> None:
        """gpu_model_runner.py:5487-5489: initialize_layerwise_reload, load_weights, finalize."""
        infos = {module: self._to_meta(module) for module in self.modules()}
        self.load_weights(weights_iterator)
        for module, info in infos.items():  # finalize_layerwise_processing (layerwise.py:244-275)
            if info["done"]:
                continue
            if info["numel"] == 0 and info["total"] > 0:  # "Failed to load weights": the old tensors back
                self._place(module, info["kernel"])
            elif info["numel"] > 0:
                self._process(module, info)

    @staticmethod
    def _to_meta(module: nn.Module) -> dict:
        """reload/layerwise.py:103-145: keep the module's tensors, put meta ones in their place, each with a
        loader that buffers what arrives and processes the module once all its elements did."""
        kernel = {n: p for n, p in module._parameters.items() if p is not None}
        info = {"kernel": kernel, "buffered": [], "numel": 0, "done": False,
                "total": sum(p.numel() for n, p in kernel.items() if n not in SKIP)}
        for name, param in kernel.items():
            if name in SKIP:
                continue
            meta = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                requires_grad=False)

            def loader(param_, loaded, name=name):
                strict_loader(param_, loaded)  # on meta: checks and counts, stores nothing
                info["buffered"].append((name, loaded))
                info["numel"] += param_.numel()
                if info["numel"] >= info["total"]:
                    ReloadingConsumer._process(module, info)

            meta.weight_loader = loader
            module.register_parameter(name, meta)
        return info

    @staticmethod
    def _process(module: nn.Module, info: dict) -> None:
        """layerwise.py:331-369: materialise, load what was buffered, copy into the old tensors, put those
        back (cudagraphs hold them)."""
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                module.register_parameter(name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                             requires_grad=False))
        for name, loaded in info["buffered"]:
            strict_loader(module._parameters[name], loaded)
        for name, old in info["kernel"].items():
            old.data.copy_(module._parameters[name])
        ReloadingConsumer._place(module, info["kernel"])
        info["done"] = True

    @staticmethod
    def _place(module: nn.Module, kernel: dict) -> None:
        for name, param in kernel.items():
            module.register_parameter(name, param)


def consumer_for(stream, expected_fp32: set[str], **kwargs) -> ReloadingConsumer:
    """A consumer with vLLM's parameter of every HF tensor the stream names: its shape, and the dtype vLLM
    gives it (written from vLLM's code, not from the stream: a wrong dtype in the stream fails the load)."""
    shapes = {}
    for hf_name, tensor in stream:
        name = vllm_name(hf_name)
        if name is None:
            continue
        if hf_name in expected_fp32 or hf_name.endswith("wo_a.scale"):
            dtype = torch.float32
        elif hf_name.endswith("wo_a.weight"):
            dtype = torch.float8_e4m3fn
        else:
            dtype = DTYPE if tensor.is_floating_point() else tensor.dtype
        shapes[name] = (tuple(tensor.shape), dtype)
    return ReloadingConsumer(shapes, **kwargs)


def _check_loaded(consumer: ReloadingConsumer, stream) -> None:
    """Every parameter the stream fills holds the stream's values (the sinks aside)."""
    params = dict(consumer.named_parameters())
    for hf_name, tensor in stream:
        name = vllm_name(hf_name)
        if name is not None and "attn_sink" not in name:
            got = params[name].view(-1).view(torch.uint8)
            assert torch.equal(got, tensor.view(-1).view(torch.uint8)), name


class InProcessLLM:
    """vLLM's LLM as the rollout drives it in-process: apply_model runs the function on the one worker's
    model (entrypoints/llm.py:603-614, v1/worker/worker_base.py:128-130)."""

    def __init__(self, model):
        self.model = model

    def apply_model(self, fn):
        return [fn(self.model)]


def test_a_reload_loses_the_sinks_and_the_resend_restores_them(one):
    rt, trainer, stream, _ = one
    expected = vllm_fp32_names(rt.arch)
    sinks_hf = sorted(n for n in expected if n.endswith("attn_sink"))
    consumer = consumer_for(stream, expected)

    def sinks_of(model):
        return {n: dict(model.named_parameters())[vllm_name(n)][:4].clone() for n in sinks_hf}

    for garbage in (None, 7.0):  # after the dummy load (the first session), after a level-2 sleep
        if garbage is not None:
            consumer.sleep_level_2_and_wake(garbage)
        before = sinks_of(consumer)
        kept: dict[str, torch.Tensor] = {}
        consumer.reload_weights(vllm_adapter.keep_attention_sinks(iter(stream), kept))
        _check_loaded(consumer, stream)  # everything else landed, in vLLM's dtypes
        after = sinks_of(consumer)
        assert sorted(kept) == sinks_hf  # the main layers' sinks, not the MTP layer's (vLLM skips it)
        for n in sinks_hf:  # the reload left the sinks as they were: not the trainer's
            assert torch.equal(after[n], before[n]) and not torch.equal(after[n], trainer[n]), n
        vllm_adapter.resend_attention_sinks(InProcessLLM(consumer), kept, tp_rank=0, tp_size=1)
        for n in sinks_hf:
            assert torch.equal(sinks_of(consumer)[n], trainer[n]), n
    # the padding slots past the heads stay as they were (-inf, then the dummy's, then garbage)
    assert all(bool((p[4:] == 7.0).all()) for n, p in consumer.named_parameters() if n.endswith("attn_sink"))


def test_the_resend_cuts_each_tensor_parallel_ranks_heads(one):
    rt, trainer, stream, _ = one
    expected = vllm_fp32_names(rt.arch)
    for tp_rank in range(2):
        consumer = consumer_for(stream, expected, tp_rank=tp_rank, tp=2)
        kept: dict[str, torch.Tensor] = {}
        consumer.reload_weights(vllm_adapter.keep_attention_sinks(iter(stream), kept))
        names = vllm_adapter.set_attention_sinks(consumer, kept, tp_rank=tp_rank, tp_size=2)
        assert sorted(names) == sorted(vllm_name(n) for n in kept)
        params = dict(consumer.named_parameters())
        for n in kept:
            heads = params[vllm_name(n)]
            assert torch.equal(heads[:2], trainer[n][2 * tp_rank:2 * tp_rank + 2]), (n, tp_rank)
            assert not bool(heads[2:].isnan().any())  # the padding: the dummy load's, untouched


def test_the_resend_is_refused_where_vllm_has_no_sink_of_that_name():
    class NoSinks(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2), requires_grad=False)

    sinks = {"layers.0.attn.attn_sink": torch.ones(4)}
    with pytest.raises(MliteError, match="vllm_adapter.py was checked against vLLM 0.25.1"):
        vllm_adapter.resend_attention_sinks(InProcessLLM(NoSinks()), sinks, tp_rank=0, tp_size=1)
    vllm_adapter.resend_attention_sinks(InProcessLLM(NoSinks()), {})  # nothing to send: no call


# ------------------------------------------------------------------------------------------- two ranks
def _worker(rank, world, root):
    from mlite.runtime.engine import Runtime

    root = Path(root)
    rt = Runtime(job_from_dict(job(root / "v4", {"ep": 2})))
    out = {}
    for tp in (1, 2):
        for fp8 in ("wo_a", "online", "linears")[:3 if tp == 1 else 2]:  # tiny widths: no 128-blocks at tp2
            stats: dict = {}
            out[tp, fp8] = [(n, t.clone()) for n, t in sync.tp_group_weights(
                rt.held_models(), DTYPE, tp, rt.arch.num_kv_heads, stats, v4_fp8=fp8,
                num_experts=rt.arch.moe.num_experts if fp8 == "linears" else None)]
    torch.save(out, root / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Both ranks' streams under ep2 (with dp2: FSDP shards every tensor over the two ranks, so pieces of the
    float32 tensors and of wo_a travel between them), and the model's HF tensors on one process."""
    from parallel_harness import launch

    from mlite.config.arch import arch_from_hf_config
    from mlite.runtime.ckpt.hf import iter_hf_weights
    from mlite.runtime.models import build_model, seeded_init

    root = tmp_path_factory.mktemp("dsv4sync")
    (root / "v4").mkdir()
    (root / "v4" / "config.json").write_text(json.dumps(CONFIG))
    spec = job_from_dict(job(root / "v4"))
    arch = arch_from_hf_config(CONFIG)
    model = build_model(arch, "torch", init=False, mtp_weight=spec.model.mtp_loss_weight,
                        indexer_loss_weight=spec.model.indexer_loss_weight)
    seeded_init(model, spec.trainer.seed)
    reference = {k: v.clone() for k, v in iter_hf_weights(model)}
    launch(2, _worker, str(root))
    return arch, reference, [torch.load(root / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("tp,fp8", [(1, "wo_a"), (1, "online"), (1, "linears"), (2, "wo_a"), (2, "online")])
def test_across_ranks_the_fp32_tensors_arrive_unrounded_and_wo_a_as_fp8(two, tp, fp8):
    arch, reference, ranks = two
    expected = vllm_fp32_names(arch)
    for rank, result in enumerate(ranks):
        stream = result[tp, fp8]
        assert [n for n, _ in stream] == [n for n, _ in ranks[0][tp, fp8]]  # one order on every rank
        got = dict(stream)
        for name, want in reference.items():
            if name.startswith("mtp."):
                continue
            if sync.vllm_send_as(name, fp8) == "fp8":
                scale = got[name.removesuffix(".weight") + ".scale"]
                back = dequantize(got[name], scale, block=(128, 128))
                assert bool(((back - want).abs() <= fp8_bound(want, scale)).all()), (name, rank)
                continue
            tensor = got[name]
            slab = sync.consumer_slab(name, tuple(want.shape), tp, rank % tp, arch.num_kv_heads)
            inside = [slice(None)] * want.dim()
            if slab is not None:
                inside[slab[0]] = slice(slab[1], slab[2])
            inside = tuple(inside)
            if name in expected:
                assert tensor.dtype == torch.float32 and slab is None and torch.equal(tensor, want), name
            elif want.is_floating_point():
                assert tensor.dtype == DTYPE and torch.equal(tensor[inside], want.to(DTYPE)[inside]), name


def test_a_slab_sent_in_fp8_is_its_blocks_of_the_whole_and_zero_elsewhere():
    """rollout.fp8_weights on an engine of several GPUs: a column-parallel linear's slab (here rows 128-255
    of 256) goes as the whole tensor's FP8 blocks, which the consumer cuts with their scales; the rows it
    does not read are zeros. A slab off the 128-wide blocks is refused (the planner refuses such a
    rollout.tp first)."""
    weight = torch.randn(256, 384)
    whole = torch.full_like(weight, float("nan"))
    whole[128:] = weight[128:]
    (name, fp8, kept), (scale_name, scale, _) = sync._as_sent("x.w1.weight", whole, (0, 128, 256), "fp8")
    assert name == "x.w1.weight" and scale_name == "x.w1.scale" and kept == 128 * 384
    back = dequantize(fp8, scale, block=(128, 128))
    assert bool(((back[128:] - weight[128:]).abs() <= fp8_bound(weight[128:], scale[1:])).all())
    assert bool((back[:128] == 0).all())
    with pytest.raises(MliteError, match="128-wide blocks"):
        sync._as_sent("x.w1.weight", whole, (0, 64, 192), "fp8")
