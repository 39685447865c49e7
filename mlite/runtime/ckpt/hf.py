"""HF safetensors checkpoints: load into a native model, stream out of it, write sharded exports.

The model says how each of its parameters is stored (`model.hf_layout()`: HF names plus split / join, e.g.
per-expert tensors for a stacked MoE parameter); this module does the file work. Loading reads one
parameter's tensors at a time from single-file or sharded (`model.safetensors.index.json`) checkpoints,
converting dtypes; exporting consumes a stream of (HF name, tensor) and holds at most one shard in memory.
Every mismatch (a wrong shape, a missing or an extra tensor, an unreadable file) is one MliteError line
that names the tensor or file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from mlite.config.arch import ModelArch
from mlite.errors import MliteError
from mlite.runtime.ckpt import quant

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 1024**3  # transformers' own default shard size

WeightStream = Iterable[tuple[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------------- reading
class _SafetensorsCheckpoint:
    """The tensors of a checkpoint (a directory, an index file or one .safetensors file), read lazily.

    Released quantised checkpoints (DeepSeek's FP8 / FP4 weights with ue8m0 block scales, see
    `mlite.runtime.ckpt.quant`) read as full precision: a weight's `X.scale` (or `X.weight_scale_inv`)
    companion is part of `X.weight`, not one of `file_of`'s names; `shape` is the dequantised shape and
    `tensor` the dequantised float32 tensor. Other checkpoints read as stored."""

    def __init__(self, path: str | Path, canonical=None):
        """`canonical(stored name) -> name`: the names the model asks for, when a checkpoint may spell them
        another way (DeepSeek-V4 as transformers writes it vs DeepSeek's release)."""
        self.path = Path(path)
        self._open: dict[Path, object] = {}
        self._root = self.path
        self._files = self._weight_map()  # every stored tensor -> file
        self.quantization = quant.read_quantization_config(self._root)
        self.scale_of = self._pair_scales()  # quantised weight -> its scale tensor
        scales = set(self.scale_of.values())
        rename = canonical or (lambda name: name)
        self._stored = {rename(name): name for name in self._files if name not in scales}
        # HF name -> file
        self.file_of = {name: self._files[stored] for name, stored in self._stored.items()}

    def _weight_map(self) -> dict[str, Path]:
        p = self.path
        if p.is_dir():
            if (p / INDEX_FILE).is_file():
                p = p / INDEX_FILE
            elif (p / SINGLE_FILE).is_file():
                p = p / SINGLE_FILE
            else:
                raise MliteError(
                    f"no {SINGLE_FILE} or {INDEX_FILE} in {self.path}; is it an HF checkpoint directory?"
                )
        if not p.is_file():
            raise MliteError(f"no checkpoint at {p}; pass an HF checkpoint directory or a .safetensors file")
        self._root = p.parent  # where config.json lives
        if p.name.endswith(".json"):
            try:
                weight_map = json.loads(p.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise MliteError(
                    f"{p} is not a valid safetensors index ({type(err).__name__}: {err}); re-export it"
                ) from None
            files = {name: p.parent / file for name, file in weight_map.items()}
            for file in sorted(set(files.values())):
                if not file.is_file():
                    raise MliteError(
                        f"{p} lists shard {file.name}, which is missing; copy the complete checkpoint"
                    )
            return files
        return {name: p for name in self._handle(p).keys()}

    def _handle(self, file: Path):
        if file not in self._open:
            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except Exception as err:  # noqa: BLE001 - safetensors raises several types for bad headers or truncation
                raise MliteError(
                    f"{file} is not a readable safetensors file ({err}); re-download or re-export it"
                ) from None
        return self._open[file]

    def _slice(self, name: str):
        return self._handle(self._files[name]).get_slice(name)

    def _pair_scales(self) -> dict[str, str]:
        """Match each quantisation scale `X.scale` / `X.weight_scale_inv` to its weight `X.weight`.

        A `.scale` is a companion when its weight is there and the checkpoint is quantised (a
        quantization_config, or a quantised weight or ue8m0 scale dtype); a `.scale` that looks like a
        quantisation scale (ue8m0 bytes, or a grid in a quantised checkpoint) without its weight is an
        error. Other `.scale` tensors (e.g. a model's own 1-D scale parameters) are ordinary tensors."""
        pairs: dict[str, str] = {}
        orphans = []
        for name in self._files:
            suffix = next((s for s in quant.SCALE_SUFFIXES if name.endswith(s)), None)
            if suffix is None:
                continue
            weight = name.removesuffix(suffix) + ".weight"
            if weight not in self._files:
                orphans.append((name, weight))
            elif (
                self.quantization is not None
                or suffix != ".scale"
                or self._slice(weight).get_dtype() in _QUANTISED_DTYPES
                or self._slice(name).get_dtype() == "F8_E8M0"
            ):
                if weight in pairs:
                    raise MliteError(
                        f"tensor '{weight}' in {self._files[weight].name} has two scales, '{pairs[weight]}' "
                        f"and '{name}'; the checkpoint is corrupt: re-download or re-export it"
                    )
                pairs[weight] = name
        quantised = self.quantization is not None or bool(pairs)
        for name, weight in orphans:
            dtype, ndim = self._slice(name).get_dtype(), len(self._slice(name).get_shape())
            grid_like = quantised and (dtype == "U8" or ndim >= 2)
            if not name.endswith(".scale") or dtype == "F8_E8M0" or grid_like:
                raise MliteError(
                    f"tensor '{name}' in {self._files[name].name} is the quantisation scale of '{weight}', "
                    f"which is not in {self.path}; the checkpoint is incomplete or corrupt: copy all of its "
                    "files or re-download it"
                )
        return pairs

    def _quantised_shape(self, name: str) -> tuple[list[int], tuple[int, int]]:
        """The dequantised shape of quantised weight `name` and the block its scale grid tiles it with."""
        stored, dtype = list(self._slice(name).get_shape()), self._slice(name).get_dtype()
        fp4 = dtype in quant.FP4_SAFETENSORS
        shape = stored if dtype == "F4" else quant.logical_shape(stored, fp4)  # F4 headers count values
        scale = self.scale_of[name]
        grid = list(self._slice(scale).get_shape())
        prefer = None if fp4 or self.quantization is None else self.quantization.get("weight_block_size")
        block = quant.scale_block(shape, grid, prefer)
        if block is None:
            layout = "1x32 blocks (FP4)" if fp4 else f"{prefer or [128, 128]} blocks"
            raise MliteError(
                f"tensor '{name}' has dequantised shape {shape} in {self._files[name].name} but its scale "
                f"'{scale}' has grid {grid}, which does not tile it in {layout}; the checkpoint is corrupt: "
                "re-download or re-export it"
            )
        return shape, block

    def shape(self, name: str) -> list[int]:
        name = self._stored[name]
        if name in self.scale_of:
            return self._quantised_shape(name)[0]
        return list(self._slice(name).get_shape())

    @contextlib.contextmanager
    def _reading(self, name: str):
        """Any failure reading stored tensor `name` is a corrupt file to the user: one line."""
        try:
            yield
        except MliteError:
            raise
        except Exception as err:  # noqa: BLE001
            raise MliteError(
                f"cannot read tensor '{name}' from {self._files[name]} ({err}); the file is corrupt"
            ) from None

    def _read(self, name: str) -> torch.Tensor:
        with self._reading(name):
            return self._handle(self._files[name]).get_tensor(name)

    def region(self, name: str, indices: list[torch.Tensor | None]) -> torch.Tensor:
        """The entries of tensor `name` at `indices` (per dim: global indices, None for the whole dim): a
        sharded rank reads its share only. A stored tensor is read as one slice over the indices' span
        (`get_slice`); a quantised one is dequantised whole (its scale blocks tile the whole weight)."""
        stored = self._stored[name]
        if stored in self.scale_of:
            return _select(self.tensor(name), indices)
        spans = tuple(slice(None) if i is None else slice(int(i.min()), int(i.max()) + 1) if i.numel()
                      else slice(0, 0) for i in indices)
        with self._reading(stored):
            part = self._slice(stored)[spans] if spans else self._read(stored)
        return _select(part, [None if i is None else i - s.start for i, s in zip(indices, spans)])

    def tensor(self, name: str) -> torch.Tensor:
        name = self._stored[name]
        if name not in self.scale_of:
            return self._read(name)
        _, block = self._quantised_shape(name)
        scale = self.scale_of[name]
        try:
            return quant.dequantize(self._read(name), self._read(scale), block)
        except ValueError as err:
            raise MliteError(
                f"cannot dequantise tensor '{name}' with its scale '{scale}' from {self._files[name].name} "
                f"({err}); the checkpoint is corrupt: re-download or re-export it"
            ) from None


def _select(tensor: torch.Tensor, indices: list[torch.Tensor | None]) -> torch.Tensor:
    for dim, index in enumerate(indices):
        if index is not None and not (index.numel() == tensor.shape[dim]
                                      and torch.equal(index, torch.arange(tensor.shape[dim]))):
            tensor = tensor.index_select(dim, index)
    return tensor


# safetensors dtypes of weights that carry a scale (FP8, and FP4 packed in bytes or as F4)
_QUANTISED_DTYPES = ("F8_E4M3", "F8_E5M2", *quant.FP4_SAFETENSORS)


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What `hf_layout` names: parameters, and the buffers a checkpoint holds (DeepSeek-V4's hash tables and
    router correction biases)."""
    return dict(model.named_parameters()) | dict(model.named_buffers())


def _expected_names(model: nn.Module) -> set[str]:
    """Every tensor name a complete checkpoint of this architecture holds (all pipeline stages, all
    experts)."""
    from mlite.runtime.models import build_model

    # with the MTP block when the architecture has one: a released checkpoint holds it, used or not
    mtp = 1.0 if model.arch.v4 is not None and model.arch.mtp_layers else 0.0
    whole = build_model(model.arch, attention_backend="torch", device="meta", init=False, mtp_weight=mtp)
    names = {name for t in whole.hf_layout() for name in t.hf_names}
    if model.arch.tie_embeddings:
        names.add("lm_head.weight")  # some tied checkpoints store the LM head too; it is the embedding
    return names


def _describe(arch: ModelArch) -> str:
    experts = f", {arch.moe.num_experts} experts" if arch.moe else ""
    return f"{arch.model_type} with {arch.num_layers} layers, hidden {arch.hidden}{experts}"


def load_hf_weights(model: nn.Module, path: str | Path, dtype: torch.dtype | None = None) -> set[str]:
    """Fill `model`'s parameters from an HF safetensors checkpoint, one parameter at a time; returns the
    names of the tensors it filled.

    Tensors are converted to the parameter dtype (`dtype`, when given, converts the model first). Each rank
    reads only what it holds: a pipeline stage its own tensors, an expert-parallel rank its experts' tensors
    (one per expert in the checkpoint), a sharded parameter (FSDP2, TP; DTensor) the rows and columns of its
    shard. A tensor that belongs to no stage of the architecture is an error."""
    from mlite.runtime.parallel.parallelize import local_shard

    if dtype is not None:
        model.to(dtype)
    ckpt = _SafetensorsCheckpoint(path, getattr(model, "canonical_hf_name", None))
    extra = sorted(set(ckpt.file_of) - _expected_names(model))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise MliteError(
            f"tensor '{extra[0]}'{more} in {path} is not a parameter of {_describe(model.arch)}; "
            "the weights do not match the config: use the config.json that came with them"
        )
    params = _tensors(model)
    for entry in model.hf_layout():
        missing = [name for name in entry.hf_names if name not in ckpt.file_of]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise MliteError(
                f"tensor '{missing[0]}'{more} is missing from {path}; the checkpoint is incomplete or is not "
                f"{_describe(model.arch)}"
            )
        param = params[entry.param]
        expected = entry.split(torch.empty(param.shape, device="meta"))
        for name, want in zip(entry.hf_names, expected):
            have = ckpt.shape(name)
            if have != list(want.shape):
                raise MliteError(
                    f"tensor '{name}' has shape {have} in {ckpt.file_of[name].name} but "
                    f"{_describe(model.arch)} expects {list(want.shape)}; the weights do not match the "
                    "config: use the config.json that came with them"
                )
        local, indices = local_shard(param)
        with torch.no_grad():
            local.copy_(_read_share(ckpt, entry, param.shape, indices))
    return {entry.param for entry in model.hf_layout()}


def _read_share(ckpt: _SafetensorsCheckpoint, entry, shape: torch.Size, indices: list) -> torch.Tensor:
    """This rank's entries (`indices`, see local_shard) of one native tensor. One stored tensor of the same
    shape is the native tensor: its share is read directly. Several stored tensors stacked along dim 0 (the
    experts: `len(hf_names)` a multiple of dim 0, that many names per index, in order) are read only for the
    indices this rank holds, and joined. Anything else is read whole and joined."""
    names = entry.hf_names
    if len(names) == 1 and ckpt.shape(names[0]) == list(shape):
        return ckpt.region(names[0], indices)
    rows = indices[0] if indices else None
    if rows is not None and len(shape) and shape[0] and len(names) % shape[0] == 0:
        per = len(names) // shape[0]
        picked = [names[i * per + j] for i in rows.tolist() for j in range(per)]
        if not picked:
            return torch.empty(0, *shape[1:])
        part = entry.join([ckpt.tensor(name) for name in picked])
        if list(part.shape) == [len(rows), *shape[1:]]:
            return _select(part, [None, *indices[1:]])
    return _select(entry.join([ckpt.tensor(name) for name in names]), indices)


# ---------------------------------------------------------------------------------------------- writing
def load_hf_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Fill `model`'s parameters from HF-named tensors in memory (a whole `Runtime.export_weights()` stream,
    e.g. a rollout replica's weight update), converted to each parameter's device and dtype."""
    params = _tensors(model)
    with torch.no_grad():
        for entry in model.hf_layout():
            missing = [name for name in entry.hf_names if name not in tensors]
            if missing:
                raise MliteError(
                    f"tensor '{missing[0]}' is missing from the weight update; the sender is not "
                    f"{_describe(model.arch)}"
                )
            param = params[entry.param]
            param.copy_(entry.join([tensors[name] for name in entry.hf_names]).to(param.device, param.dtype))


def iter_hf_weights(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (HF name, tensor) for every parameter, one parameter's tensors at a time (views, no copies
    unless `dtype` converts). FSDP-sharded parameters are gathered one at a time."""
    from mlite.runtime.parallel.parallelize import full_tensor

    params = _tensors(model)
    for entry in model.hf_layout():
        tensor = full_tensor(params[entry.param].detach())
        for name, piece in zip(entry.hf_names, entry.split(tensor)):
            yield name, piece if dtype is None else piece.to(dtype)


ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
}


def hf_config_from_arch(arch: ModelArch, dtype: torch.dtype = torch.float32) -> dict:
    """An HF config.json for `arch` (the inverse of mlite.config.arch.arch_from_hf_config)."""
    if arch.model_type not in ARCHITECTURES:
        raise MliteError(
            f"cannot write an HF config for model_type '{arch.model_type}'; pass the source config.json"
        )
    if arch.v4 is not None:
        return _deepseek_v4_config(arch, dtype)
    rope = {"rope_type": "default", "rope_theta": arch.rope_theta}
    rope.update(arch.rope_scaling or {})
    cfg = {
        "architectures": [ARCHITECTURES[arch.model_type]],
        "model_type": arch.model_type,
        "vocab_size": arch.vocab,
        "hidden_size": arch.hidden,
        "intermediate_size": arch.ffn,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": arch.hidden_act,
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": arch.tie_embeddings,
        "attention_bias": arch.attention_bias,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if arch.moe is not None:
        cfg |= {
            "num_experts": arch.moe.num_experts,
            "num_experts_per_tok": arch.moe.top_k,
            "moe_intermediate_size": arch.moe.expert_ffn,
            "norm_topk_prob": arch.moe.norm_topk_prob,
            "router_aux_loss_coef": arch.moe.router_aux_loss_coef,
            "decoder_sparse_step": arch.moe.layer_freq,
            "mlp_only_layers": list(arch.moe.dense_layers),
        }
    return cfg


def _deepseek_v4_config(arch: ModelArch, dtype: torch.dtype) -> dict:
    """DeepSeek's release config.json (`_deepseek_v4_release_fields`) with transformers' spelling of the layer
    kinds beside it (named, so no default schedule applies; transformers prefers them to the release's)."""
    v4, moe = arch.v4, arch.moe
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    hca = [r for r in v4.compress_ratios if r not in kinds]
    return {
        "architectures": [ARCHITECTURES["deepseek_v4"]], "model_type": "deepseek_v4",
        **_deepseek_v4_release_fields(arch),
        "partial_rotary_factor": v4.qk_rope_head_dim / arch.head_dim,
        "layer_types": [kinds.get(r, "heavily_compressed_attention") for r in v4.compress_ratios],
        "compress_rates": {"compressed_sparse_attention": 4,
                           "heavily_compressed_attention": hca[0] if hca else 128},
        "mlp_layer_types": ["hash_moe" if i < v4.num_hash_layers else "moe" for i in range(arch.num_layers)],
        "router_aux_loss_coef": moe.router_aux_loss_coef, "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _deepseek_v4_release_fields(arch: ModelArch) -> dict:
    """The fields of DeepSeek's release config.json, spelled as released: vLLM's DeepSeek-V4 code reads them
    directly (tests/fixtures/vllm_0_25_1_dsv4_config_fields.json lists where)."""
    v4, moe = arch.v4, arch.moe
    return {
        "vocab_size": arch.vocab, "hidden_size": arch.hidden, "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim, "qk_rope_head_dim": v4.qk_rope_head_dim,
        "q_lora_rank": v4.q_lora_rank, "o_groups": v4.o_groups, "o_lora_rank": v4.o_lora_rank,
        "sliding_window": v4.sliding_window,
        # one entry per layer, then the MTP layers' (sliding window, 0), as released
        "compress_ratios": [*v4.compress_ratios, *[0] * arch.mtp_layers],
        "index_n_heads": v4.index_n_heads, "index_head_dim": v4.index_head_dim, "index_topk": v4.index_topk,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.shared_experts, "moe_intermediate_size": moe.expert_ffn,
        "norm_topk_prob": moe.norm_topk_prob, "scoring_func": "sqrtsoftplus",
        # vLLM gives the bias-routed layers their correction bias (`ffn.gate.bias`) only for this method
        "topk_method": "noaux_tc",
        "routed_scaling_factor": v4.routed_scaling_factor, "swiglu_limit": v4.swiglu_limit,
        "num_hash_layers": v4.num_hash_layers,
        "hc_mult": v4.hc_mult, "hc_sinkhorn_iters": v4.hc_sinkhorn_iters, "hc_eps": v4.hc_eps,
        "rope_theta": arch.rope_theta, "compress_rope_theta": v4.compress_rope_theta,
        "rope_scaling": _deepseek_v4_rope_scaling(arch),
        "num_nextn_predict_layers": arch.mtp_layers, "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps, "hidden_act": arch.hidden_act,
    }


def _deepseek_v4_rope_scaling(arch: ModelArch) -> dict:
    """The compressed layers' YaRN (the release applies none to the sliding-window layers). Without scaling,
    YaRN of factor 1, which is plain RoPE: vLLM builds V4's rotary embedding (fp32 cos/sin, which its
    kernels require) from a YaRN entry only, over original_max_position_embeddings x factor positions."""
    if arch.v4.compress_rope_scaling:
        return dict(arch.v4.compress_rope_scaling)
    return {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": arch.max_position_embeddings,
            "beta_fast": 32, "beta_slow": 1}


def save_hf_checkpoint(
    source: nn.Module | WeightStream,
    arch: ModelArch,
    out_dir: str | Path,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    config: dict | str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write an HF checkpoint from a model or a (name, tensor) stream: shards of at most `max_shard_bytes`
    (a single `model.safetensors` when it fits, else numbered shards and an index) and a config.json
    (`config`: a dict or the source config.json to copy; by default made from `arch`).

    Holds one shard in memory at a time. Written to a temporary sibling directory and renamed into place,
    so a failed export never leaves a half-written checkpoint at `out_dir`."""
    out = Path(out_dir)
    tmp = _export_tmp_dir(out)
    stream = iter_hf_weights(source, dtype) if isinstance(source, nn.Module) else source
    try:
        stored_dtype = _write_shards(stream, tmp, max_shard_bytes, dtype)
        write_hf_config(tmp / "config.json", arch, config, stored_dtype)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_export_dir(out_dir: str | Path) -> None:
    """Refuse an export directory `save_hf_checkpoint` could not write, before any model is built; makes
    nothing (a probe directory in the nearest existing folder, removed at once)."""
    out = Path(out_dir)
    above = _export_base(out)
    with _unwritable(out):
        os.rmdir(tempfile.mkdtemp(prefix=".mlite-export-probe.", dir=above))


def _export_tmp_dir(out: Path) -> Path:
    """A new temporary sibling of `out` to write the export into."""
    _export_base(out)
    with _unwritable(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))


def _export_base(out: Path) -> Path:
    """The nearest existing folder at or above `out`; refuses an `out` that is a file or a non-empty
    directory (nothing of it is touched) or that lies under a file."""
    with _unwritable(out):
        if out.exists() and not out.is_dir():
            raise MliteError(f"{out} exists and is not a directory; choose a new export directory")
        above = next((p for p in (out, *out.parents) if p.exists()), Path("."))
        if not above.is_dir():
            raise MliteError(f"{above} is a file, not a directory: {out} cannot be made there; "
                             "choose another export directory")
        if above == out and any(out.iterdir()):
            raise MliteError(f"{out} exists and is not empty; choose a new export directory or remove it")
    return above


@contextlib.contextmanager
def _unwritable(out: Path):
    try:
        yield
    except OSError as err:
        raise MliteError(f"cannot write the export directory {out} ({err.strerror}); "
                         "choose a writable place") from None


def _write_shards(stream: WeightStream, tmp: Path, max_shard_bytes: int, dtype) -> torch.dtype:
    """Write the stream as shards; returns the dtype of the first tensor (what config.json records)."""
    shard: dict[str, torch.Tensor] = {}
    stored_dtype = dtype
    shard_bytes, total, files, seen = 0, 0, [], set()

    def flush():
        nonlocal shard, shard_bytes
        files.append((f"shard-{len(files):05d}.safetensors", list(shard)))
        save_file(shard, str(tmp / files[-1][0]), metadata={"format": "pt"})
        shard, shard_bytes = {}, 0

    for name, tensor in stream:
        if name in seen:
            raise MliteError(
                f"tensor '{name}' appears twice in the weight stream; each HF name must be written once"
            )
        seen.add(name)
        tensor = tensor.detach().to("cpu", dtype=dtype or tensor.dtype)
        stored_dtype = stored_dtype or tensor.dtype
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor.contiguous().clone()  # own storage: split views of one parameter share theirs
        shard_bytes += nbytes
        total += nbytes
    if shard or not files:
        flush()

    if len(files) == 1:
        os.replace(tmp / files[0][0], tmp / SINGLE_FILE)
        return stored_dtype or torch.float32
    weight_map = {}
    for i, (temp_name, names) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(tmp / temp_name, tmp / final)
        weight_map |= {name: final for name in names}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return stored_dtype or torch.float32


def write_hf_config(dest: Path, arch: ModelArch, config, dtype) -> None:
    """config.json at `dest`: a copy of `config` (a dict, or a source config.json or its directory), or
    made from `arch` with `dtype` recorded. A dict without `architectures` (a catalog preset's) gets the
    model class, which vLLM and transformers' Auto classes read; a DeepSeek-V4 dict gets the release fields
    it lacks."""
    if isinstance(config, (str, Path)):
        src = Path(config)
        src = src / "config.json" if src.is_dir() else src
        if not src.is_file():
            raise MliteError(f"no config.json at {config}; pass the source checkpoint's config.json")
        shutil.copyfile(src, dest)
        return
    cfg = dict(config) if config is not None else hf_config_from_arch(arch, dtype)
    if arch.model_type in ARCHITECTURES:
        cfg.setdefault("architectures", [ARCHITECTURES[arch.model_type]])
    if arch.v4 is not None:
        # a preset's or transformers' spelling lacks release fields vLLM reads directly; `arch` was read
        # from this config, so the fields made from it say the same
        for key, value in _deepseek_v4_release_fields(arch).items():
            if cfg.get(key) is None:
                cfg[key] = value
    dest.write_text(json.dumps(cfg, indent=2) + "\n")
