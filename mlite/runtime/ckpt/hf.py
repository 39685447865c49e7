"""HF safetensors checkpoints: load into a native model, stream out of it, write sharded exports.

The model says how each of its parameters is stored (`model.hf_layout()`: HF names plus split / join, e.g.
per-expert tensors for a stacked MoE parameter); this module does the file work. Loading reads one
parameter's tensors at a time from single-file or sharded (`model.safetensors.index.json`) checkpoints,
converting dtypes; exporting consumes a stream of (HF name, tensor) and holds at most one shard in memory.
Every mismatch (a wrong shape, a missing or an extra tensor, an unreadable file) is one MliteError line
that names the tensor or file.
"""

from __future__ import annotations

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

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 1024**3  # transformers' own default shard size

WeightStream = Iterable[tuple[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------------- reading
class _SafetensorsCheckpoint:
    """The tensors of a checkpoint (a directory, an index file or one .safetensors file), read lazily."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._open: dict[Path, object] = {}
        self.file_of = self._weight_map()  # HF name -> file

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

    def shape(self, name: str) -> list[int]:
        return list(self._handle(self.file_of[name]).get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self._handle(self.file_of[name]).get_tensor(name)
        except MliteError:
            raise
        except Exception as err:  # noqa: BLE001 - any read failure is a corrupt file to the user
            raise MliteError(
                f"cannot read tensor '{name}' from {self.file_of[name]} ({err}); the file is corrupt"
            ) from None


def _expected_names(model: nn.Module) -> set[str]:
    """Every tensor name a complete checkpoint of this architecture holds (all pipeline stages, all
    experts)."""
    from mlite.runtime.models import build_model

    whole = build_model(model.arch, attention_backend="torch", device="meta", init=False)
    names = {name for t in whole.hf_layout() for name in t.hf_names}
    if model.arch.tie_embeddings:
        names.add("lm_head.weight")  # some tied checkpoints store the LM head too; it is the embedding
    return names


def _describe(arch: ModelArch) -> str:
    experts = f", {arch.moe.num_experts} experts" if arch.moe else ""
    return f"{arch.model_type} with {arch.num_layers} layers, hidden {arch.hidden}{experts}"


def load_hf_weights(model: nn.Module, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Fill `model`'s parameters from an HF safetensors checkpoint, one parameter at a time.

    Tensors are converted to the parameter dtype (`dtype`, when given, converts the model first). A pipeline
    stage reads only its own tensors; a tensor that belongs to no stage of the architecture is an error."""
    if dtype is not None:
        model.to(dtype)
    ckpt = _SafetensorsCheckpoint(path)
    extra = sorted(set(ckpt.file_of) - _expected_names(model))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise MliteError(
            f"tensor '{extra[0]}'{more} in {path} is not a parameter of {_describe(model.arch)}; "
            "the weights do not match the config: use the config.json that came with them"
        )
    params = dict(model.named_parameters())
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
        with torch.no_grad():
            param.copy_(entry.join([ckpt.tensor(name) for name in entry.hf_names]))


# ---------------------------------------------------------------------------------------------- writing
def load_hf_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Fill `model`'s parameters from HF-named tensors in memory (a whole `Runtime.export_weights()` stream,
    e.g. a rollout replica's weight update), converted to each parameter's device and dtype."""
    params = dict(model.named_parameters())
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

    params = dict(model.named_parameters())
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
}


def hf_config_from_arch(arch: ModelArch, dtype: torch.dtype = torch.float32) -> dict:
    """An HF config.json for `arch` (the inverse of mlite.config.arch.arch_from_hf_config)."""
    if arch.model_type not in ARCHITECTURES:
        raise MliteError(
            f"cannot write an HF config for model_type '{arch.model_type}'; pass the source config.json"
        )
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
    if out.exists() and any(out.iterdir()):
        raise MliteError(f"{out} exists and is not empty; choose a new export directory or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    stream = iter_hf_weights(source, dtype) if isinstance(source, nn.Module) else source
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        stored_dtype = _write_shards(stream, tmp, max_shard_bytes, dtype)
        _write_config(tmp / "config.json", arch, config, stored_dtype)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


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


def _write_config(dest: Path, arch: ModelArch, config, dtype) -> None:
    if isinstance(config, (str, Path)):
        src = Path(config)
        src = src / "config.json" if src.is_dir() else src
        if not src.is_file():
            raise MliteError(f"no config.json at {config}; pass the source checkpoint's config.json")
        shutil.copyfile(src, dest)
        return
    cfg = dict(config) if config is not None else hf_config_from_arch(arch, dtype)
    dest.write_text(json.dumps(cfg, indent=2) + "\n")
