"""Block-quantised weights as DeepSeek releases them: FP8 e4m3 and FP4 e2m1 values with power-of-two scales.

A quantised weight `X.weight` comes with a companion `X.scale` holding one scale per block; the block shape
follows from the two shapes (`scale_block`): 128x128 blocks for the FP8 linear weights, 1x32 for the FP4
routed experts (two e2m1 values packed per byte, low nibble first, so the stored last dim is halved). Weight
dims need not be multiples of the block: the last block along a dim is then partial (ceil division). The
value of an element is its decoded value times the scale of its block. Scales are ue8m0 (an 8-bit biased
exponent, 2**(b-127)), stored as float8_e8m0fnu or raw uint8 bytes; float scales are accepted as they are.

`dequantize` reads them (the HF loader calls it on read), `quantize_fp8_blocks` / `quantize_fp4_rows` write
them, and `save_quantized_checkpoint` writes a released-format checkpoint (for tests and tools).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from mlite.errors import MliteError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; code | 8 is the negative
FP4_DTYPE = getattr(torch, "float4_e2m1fn_x2", None)
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)
# a weight stored in one of these with a scale is packed FP4 (two e2m1 per byte)
FP4_STORAGE = tuple(d for d in (torch.int8, torch.uint8, FP4_DTYPE) if d is not None)
FP4_SAFETENSORS = ("I8", "U8", "F4")  # their safetensors header names; F4 headers count nibbles, not bytes
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")  # DeepSeek's released name, transformers' name

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


# ---------------------------------------------------------------------------------------------- decoding
def is_fp4(weight: torch.Tensor) -> bool:
    return weight.dtype in FP4_STORAGE


def decode_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 (int8, uint8 or float4_e2m1fn_x2; two values per byte, low nibble first = even column)
    -> float32 with the last dim doubled."""
    if packed.dtype not in FP4_STORAGE:
        raise ValueError(f"packed FP4 must be int8, uint8 or float4_e2m1fn_x2, not {packed.dtype}")
    signed = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)  # code 8 is -0.0
    table = torch.tensor(signed, dtype=torch.float32, device=packed.device)
    raw = packed.contiguous().view(torch.uint8).long()
    values = torch.stack([table[raw & 0xF], table[raw >> 4]], dim=-1)
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1]) if packed.ndim else values.reshape(2)


def _exponent_to_float(exponent: torch.Tensor) -> torch.Tensor:
    """2**(b-127) for biased exponents b in 0..255 (int tensor), exactly: built from float32 bit patterns
    (b=0 is the subnormal 2**-127, b=255 is NaN as in float8_e8m0fnu)."""
    b = exponent.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scales -> float32: float8_e8m0fnu and uint8 exponent bytes are 2**(b-127); float scales convert."""
    if scale.dtype == torch.uint8 or (E8M0_DTYPE is not None and scale.dtype == E8M0_DTYPE):
        return _exponent_to_float(scale.contiguous().view(torch.uint8))
    if not scale.dtype.is_floating_point:
        raise ValueError(f"a scale must be float8_e8m0fnu, uint8 exponents or a float, not {scale.dtype}")
    return scale.to(torch.float32)


def logical_shape(stored_shape: Iterable[int], fp4: bool) -> list[int]:
    """The shape of the dequantised weight: packed FP4 doubles the last dim."""
    shape = list(stored_shape)
    if fp4 and shape:
        shape[-1] *= 2
    return shape


def _block_dim(size: int, grid: int, prefer: int | None) -> int | None:
    def tiles(b: int) -> bool:
        return b >= 1 and -(-size // b) == grid

    if prefer is not None and tiles(prefer):
        return prefer
    if grid == 1:
        return max(size, 1)
    b = 1
    while b <= size:  # a power of two tiles at most one way for grid > 1 (128, 32, 1 in released checkpoints)
        if tiles(b):
            return b
        b *= 2
    if grid and size % grid == 0:
        return size // grid
    return None


def scale_block(shape: Iterable[int], grid: Iterable[int], prefer: Iterable[int] | None = None):
    """The block shape (rows, cols) with which a scale grid tiles a weight of logical `shape` (the last dims
    of both; the last block along a dim may be partial), or None when it does not tile. `prefer` (e.g. the
    config's weight_block_size) wins when it fits; else a power of two, else an exact division."""
    shape, grid = list(shape), list(grid)
    if len(grid) == 0:  # one scale for the whole tensor
        grid = shape[:-2] + [1, 1]
    if len(shape) < 2 or len(grid) != len(shape) or shape[:-2] != grid[:-2]:
        return None
    prefer = list(prefer) if prefer is not None else [None, None]
    rows = _block_dim(shape[-2], grid[-2], prefer[0])
    cols = _block_dim(shape[-1], grid[-1], prefer[1])
    return None if rows is None or cols is None else (rows, cols)


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block: Iterable[int] | None = None
) -> torch.Tensor:
    """A quantised weight and its scale grid -> float32 of the logical shape: each element's decoded value
    (FP4 unpacked, FP8 or any float converted) times its block's scale. The block shape comes from the
    grid (`scale_block`, `block` preferred when it fits); a grid that does not tile is a ValueError."""
    values = decode_fp4(weight) if is_fp4(weight) else weight.to(torch.float32)
    scales = ue8m0_to_float(scale).to(values.device)
    if scales.ndim == 0 and values.ndim >= 2:  # one scale for the whole tensor
        scales = scales.expand(*values.shape[:-2], 1, 1)
    found = scale_block(values.shape, scales.shape, block)
    if found is None or (block is not None and tuple(found) != tuple(block)):
        want = f" in {tuple(block)} blocks" if block is not None else ""
        raise ValueError(
            f"scale grid {list(scales.shape)} does not tile a weight of shape {list(values.shape)}{want}"
        )
    rows, cols = values.shape[-2:]
    full = scales.repeat_interleave(found[0], dim=-2)[..., :rows, :]
    full = full.repeat_interleave(found[1], dim=-1)[..., :cols]
    return values * full


# ---------------------------------------------------------------------------------------------- encoding
def pow2_scales(amax: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest power of two s with amax / s <= top, per block, clamped to e8m0's 2**-127 .. 2**127;
    returns (float32 scales, uint8 biased exponents). All-zero blocks get 1."""
    mantissa, exp = torch.frexp(amax.to(torch.float64) / top)  # ratio = m * 2**e, 0.5 <= m < 1
    exponent = torch.where(mantissa == 0.5, exp - 1, exp)  # ceil(log2(ratio))
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent)).clamp(-127, 127)
    biased = (exponent + 127).to(torch.uint8)
    return _exponent_to_float(biased), biased


def _as_e8m0(biased: torch.Tensor) -> torch.Tensor:
    return biased.view(E8M0_DTYPE) if E8M0_DTYPE is not None else biased


def _check_float(w: torch.Tensor, what: str) -> torch.Tensor:
    if w.ndim < 2 or not w.dtype.is_floating_point:
        raise ValueError(f"{what} takes a floating weight of 2 or more dims, not {w.dtype} {list(w.shape)}")
    w = w.detach().to(torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError(f"{what}: the weight has inf or NaN values, which no power-of-two scale represents")
    return w


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128),
                        scale_dtype: torch.dtype | None = None):
    """Float weight [..., out, in] -> (float8_e4m3fn weight, ue8m0 scale [..., ceil(out/bm), ceil(in/bn)]):
    per block a power-of-two scale so the block max fits e4m3 (448), values rounded to nearest. The last
    block along a dim may be partial. `scale_dtype` float32: the same powers of two as float32 (the
    `weight_scale_inv` of vLLM's block-FP8 linears for checkpoints with float32 scales), not ue8m0."""
    if scale_dtype not in (None, torch.float32):
        raise ValueError(f"quantize_fp8_blocks writes ue8m0 scales (scale_dtype None) or float32, not "
                         f"{scale_dtype}")
    q, scales, biased = fp8_blocks(_check_float(w, "quantize_fp8_blocks"), block)
    return q, (scales.to(torch.float32) if scale_dtype == torch.float32 else _as_e8m0(biased))


def fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_fp8_blocks`' rounding of a float32 weight [..., out, in] known to be finite (no host-side
    check, so no sync): (float8_e4m3fn weight, power-of-two scales [..., ceil(out/bm), ceil(in/bn)], their
    biased exponents)."""
    bm, bn = block
    rows, cols = w.shape[-2:]
    gr, gc = -(-rows // bm), -(-cols // bn)
    padded = torch.nn.functional.pad(w, (0, gc * bn - cols, 0, gr * bm - rows))
    blocks = padded.reshape(*w.shape[:-2], gr, bm, gc, bn)
    scales, biased = pow2_scales(blocks.abs().amax(dim=(-3, -1)), FP8_MAX)
    scaled = (blocks / scales[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = scaled.to(torch.float8_e4m3fn).reshape(padded.shape)[..., :rows, :cols].contiguous()
    return q, scales, biased


# ties go to the even code (round to nearest even, as the hardware casts do)
_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values in [-6, 6] to the nearest e2m1 code (sign in bit 3)."""
    a = x.abs()
    bounds = _E2M1_BOUNDS.to(x.device)
    code = torch.bucketize(a, bounds)  # a tie lands on the lower code
    tie = (code < len(bounds)) & (a == bounds[code.clamp(max=len(bounds) - 1)])
    code = code + (tie & (code % 2 == 1)).long()
    return code | ((x < 0) & (code != 0)).long() << 3


def quantize_fp4_rows(w: torch.Tensor, group: int = 32):
    """Float weight [..., out, in] (even `in`) -> (packed int8 [..., out, in/2], ue8m0 scale
    [..., out, ceil(in/group)]): per 1 x group block a power-of-two scale so the block max fits e2m1 (6),
    values rounded to the nearest e2m1 value, two per byte, the even column in the low nibble."""
    w = _check_float(w, "quantize_fp4_rows")
    rows, cols = w.shape[-2:]
    if cols % 2:
        raise ValueError(f"FP4 packs two values per byte: the last dim must be even, not {cols}")
    groups = -(-cols // group)
    padded = torch.nn.functional.pad(w, (0, groups * group - cols))
    blocks = padded.reshape(*w.shape[:-1], groups, group)
    scales, biased = pow2_scales(blocks.abs().amax(dim=-1), FP4_MAX)
    scaled = (blocks / scales[..., None]).clamp(-FP4_MAX, FP4_MAX)
    codes = _e2m1_codes(scaled).reshape(padded.shape)[..., :cols]
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8).contiguous(), _as_e8m0(biased)


def scale_name(weight_name: str) -> str:
    """`X.weight` -> `X.scale`, the companion's name in released checkpoints."""
    if not weight_name.endswith(".weight"):
        raise MliteError(f"only '.weight' tensors are quantised, not '{weight_name}'; drop it from the list")
    return weight_name.removesuffix(".weight") + ".scale"


def save_quantized_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    fp8_names: Iterable[str] = (),
    fp4_names: Iterable[str] = (),
    config: Mapping | None = None,
    fp8_block: tuple[int, int] = (128, 128),
    fp4_group: int = 32,
    fp4_dtype: torch.dtype = torch.int8,
) -> Path:
    """Write `tensors` as a released-format checkpoint: `out_dir/model.safetensors` (the `fp8_names` as
    e4m3 blocks, the `fp4_names` packed e2m1 in 1 x fp4_group blocks (stored as `fp4_dtype`: int8 or
    float4_e2m1fn_x2), each with its ue8m0 `.scale`; the rest as given) and `out_dir/config.json`
    (`config` plus the quantization_config). In memory at once: for tests and small tools."""
    fp8, fp4 = set(fp8_names), set(fp4_names)
    unknown = sorted((fp8 | fp4) - set(tensors))
    if unknown or fp8 & fp4:
        bad = unknown[0] if unknown else sorted(fp8 & fp4)[0]
        raise MliteError(
            f"cannot quantise '{bad}': it is not among the tensors or is listed as both FP8 and FP4; "
            "pass each weight name once"
        )
    scales = {name: scale_name(name) for name in sorted(fp8 | fp4)}  # only `.weight`s are quantised
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise MliteError(f"{out} exists and is not empty; choose a new directory or remove it")
    out.mkdir(parents=True, exist_ok=True)
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        if name in fp8:
            stored[name], stored[scales[name]] = quantize_fp8_blocks(tensor, fp8_block)
        elif name in fp4:
            q, s = quantize_fp4_rows(tensor, fp4_group)
            stored[name], stored[scales[name]] = q.view(fp4_dtype) if fp4_dtype != torch.int8 else q, s
        else:
            stored[name] = tensor.contiguous().clone()
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    quant = dict(QUANTIZATION_CONFIG, weight_block_size=list(fp8_block))
    if fp4:
        quant["expert_dtype"] = "fp4"
    cfg = dict(config or {}) | {"quantization_config": quant}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def read_quantization_config(directory: Path) -> dict | None:
    """The `quantization_config` of the config.json in `directory`, or None (no config, or not quantised).
    An unreadable config.json is left to the config loader to report."""
    try:
        quant = json.loads((Path(directory) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return quant if isinstance(quant, dict) else None
