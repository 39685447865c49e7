"""DeepSeek's released quantised checkpoint format: FP4 / ue8m0 decoding against the bit definitions, FP8
128x128 and FP4 1x32 block dequantisation (partial blocks included) against explicit loops, quantise ->
dequantise error bounds, a tiny MoE loaded from a quantised checkpoint, and one line for a corrupt one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlite.config.catalog import preset_arch
from mlite.errors import MliteError
from mlite.runtime.ckpt import quant
from mlite.runtime.ckpt.hf import (
    _SafetensorsCheckpoint,
    hf_config_from_arch,
    iter_hf_weights,
    load_hf_weights,
)
from mlite.runtime.models import build_model


def e2m1(code: int) -> float:
    """One e2m1 value from its bits: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    if exponent == 0:  # subnormal: 2**(1 - bias) * (0 + m/2)
        return sign * mantissa / 2
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def fp4_bytes(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8).view(torch.int8)


def e8m0(exponents: torch.Tensor) -> torch.Tensor:
    return exponents.to(torch.uint8).view(torch.float8_e8m0fnu)


# ---------------------------------------------------------------------------------------------- decoding
def test_decode_fp4_matches_the_e2m1_bit_definition_for_every_byte():
    assert [e2m1(c) for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    every = torch.arange(256, dtype=torch.uint8)
    want = torch.tensor([[e2m1(b & 0xF), e2m1(b >> 4)] for b in range(256)])  # low nibble first
    for packed in (every, every.view(torch.int8), every.view(torch.float4_e2m1fn_x2)):
        got = quant.decode_fp4(packed.reshape(16, 16))
        assert got.dtype == torch.float32 and got.shape == (16, 32)
        assert torch.equal(got.reshape(256, 2), want)
        assert torch.equal(torch.signbit(got.reshape(256, 2)), torch.signbit(want))  # -0.0 is code 8


def test_ue8m0_decodes_e8m0_uint8_bytes_and_floats():
    exponents = torch.arange(255, dtype=torch.uint8)
    want = torch.tensor([2.0 ** (b - 127) for b in range(255)], dtype=torch.float64).float()
    assert torch.equal(quant.ue8m0_to_float(exponents), want)
    assert torch.equal(quant.ue8m0_to_float(e8m0(exponents)), want)
    assert torch.equal(quant.ue8m0_to_float(e8m0(exponents)), e8m0(exponents).float())  # torch agrees
    assert quant.ue8m0_to_float(torch.tensor([255], dtype=torch.uint8)).isnan().all()  # e8m0's NaN
    floats = torch.tensor([0.75, 3.0])
    assert torch.equal(quant.ue8m0_to_float(floats), floats)
    assert torch.equal(quant.ue8m0_to_float(floats.bfloat16()), floats)


# ---------------------------------------------------------------------------------------------- dequantising
def random_fp8(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # no NaN patterns
    return raw.view(torch.float8_e4m3fn)


def random_exponents(shape, seed: int) -> torch.Tensor:
    return torch.randint(117, 137, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("block", [(128, 128), (16, 16), (8, 32)])
def test_fp8_block_dequant_matches_an_explicit_loop_over_blocks(block):
    rows, cols = 200, 300  # not multiples of 128: the last row and column blocks are partial
    bm, bn = block
    grid = (-(-rows // bm), -(-cols // bn))
    weight, exponents = random_fp8(rows, cols, 1), random_exponents(grid, 2)
    want = torch.empty(rows, cols)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].float()
            want[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = part * 2.0 ** (int(exponents[i, j]) - 127)
    assert quant.scale_block([rows, cols], grid) == block  # the block follows from the grid alone
    for scale in (e8m0(exponents), exponents, quant.ue8m0_to_float(exponents)):
        assert torch.equal(quant.dequantize(weight, scale), want)
        assert torch.equal(quant.dequantize(weight, scale, block), want)


def test_fp4_row_block_dequant_matches_an_explicit_loop():
    rows, cols = 6, 80  # 80 values per row: groups of 32, 32 and a partial 16
    packed, exponents = fp4_bytes(rows, cols // 2, 3), random_exponents((rows, 3), 4)
    raw = packed.view(torch.uint8)
    want = torch.empty(rows, cols)
    for r in range(rows):
        for c in range(cols):
            byte = int(raw[r, c // 2])
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            want[r, c] = e2m1(code) * 2.0 ** (int(exponents[r, c // 32]) - 127)
    assert quant.scale_block([rows, cols], [rows, 3]) == (1, 32)
    for weight in (packed, packed.view(torch.uint8), packed.view(torch.float4_e2m1fn_x2)):
        assert torch.equal(quant.dequantize(weight, e8m0(exponents)), want)
    assert torch.equal(quant.dequantize(packed, exponents, (1, 32)), want)


def test_a_grid_that_does_not_tile_is_refused():
    weight = random_fp8(200, 300, 5)
    assert quant.scale_block([200, 300], [3, 3]) is None  # no block gives 3 row blocks of 200
    with pytest.raises(ValueError, match="does not tile"):
        quant.dequantize(weight, random_exponents((3, 3), 6))
    with pytest.raises(ValueError, match="does not tile"):
        quant.dequantize(weight, random_exponents((2, 3), 6), (16, 16))


# ---------------------------------------------------------------------------------------------- round trips
def block_scales(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """Each element's scale, by an explicit loop over the grid."""
    full = torch.empty(shape)
    values = quant.ue8m0_to_float(scale)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            full[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = values[i, j]
    return full


def spread_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Normal values with magnitudes varying by orders of magnitude across blocks, some exact zeros."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 4, cols)[None, :]
    w[: rows // 7, : cols // 9] = 0.0  # an all-zero block
    return w


@pytest.mark.parametrize("block", [(128, 128), (16, 16)])
def test_fp8_round_trip_error_bounds(block):
    w = spread_weight(200, 300, 7)
    q, scale = quant.quantize_fp8_blocks(w, block)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert list(scale.shape) == [-(-200 // block[0]), -(-300 // block[1])]
    s = block_scales(scale, w.shape, block)
    err = (quant.dequantize(q, scale) - w).abs()
    # e4m3 has 3 mantissa bits: half an ulp is <= 2**-4 of the value, 2**-10 (in scale units) below 2**-6
    assert (err <= torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10)).all()
    blockmax = block_scales(quant_amax(w, block), w.shape, block)
    assert (err <= blockmax * 2.0**-3).all()
    scaled_max = quant_amax(w, block) / quant.ue8m0_to_float(scale)
    nonzero = scaled_max > 0
    assert (scaled_max[nonzero] <= 448).all() and (scaled_max[nonzero] > 224).all()  # tightest power of two


def quant_amax(w: torch.Tensor, block) -> torch.Tensor:
    rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    return torch.tensor([
        [w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].abs().max().item()
         for j in range(cols)] for i in range(rows)
    ])


def test_fp4_round_trip_error_bounds():
    w = spread_weight(7, 80, 8)
    packed, scale = quant.quantize_fp4_rows(w)
    assert packed.dtype == torch.int8 and packed.shape == (7, 40) and scale.shape == (7, 3)
    s = block_scales(scale, w.shape, (1, 32))
    x = (w / s).abs()
    assert (x <= 6).all()
    half_step = torch.where(x <= 2, 0.25, torch.where(x <= 4, 0.5, 1.0))  # e2m1 steps 0.5, 1, 2
    err = (quant.dequantize(packed, scale) - w).abs()
    assert (err <= half_step * s).all()
    exact = torch.tensor([[0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -6, -4, -3, -2, -1.5, -1, -0.5, 0]]).repeat(2, 2)
    packed, scale = quant.quantize_fp4_rows(exact)
    assert torch.equal(quant.dequantize(packed, scale), exact)  # table values survive exactly


def test_fp4_rounds_ties_to_even():
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]])  # block max 6: scale 1
    packed, scale = quant.quantize_fp4_rows(ties, group=8)
    assert quant.ue8m0_to_float(scale).item() == 1.0
    assert quant.dequantize(packed, scale).tolist() == [[0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]]


# ---------------------------------------------------------------------------------------------- checkpoints
ARCH = "tiny-qwen3-moe"


def quantised_checkpoint(tmp_path, fp8_block=(16, 16), fp4_dtype=torch.int8):
    torch.manual_seed(0)
    arch = preset_arch(ARCH)
    source = build_model(arch, attention_backend="torch")
    tensors = {name: t.clone() for name, t in iter_hf_weights(source)}
    fp8 = [n for n in tensors if ".self_attn." in n and n.endswith("_proj.weight")]
    fp4 = [n for n in tensors if ".mlp.experts." in n]
    assert fp8 and fp4
    out = quant.save_quantized_checkpoint(
        tensors, tmp_path / "quantised", fp8, fp4, hf_config_from_arch(arch), fp8_block, fp4_dtype=fp4_dtype
    )
    return arch, tensors, out, set(fp8), set(fp4)


@pytest.mark.parametrize(
    "fp8_block, fp4_dtype",
    [((16, 16), torch.int8), ((128, 128), torch.float4_e2m1fn_x2)],  # 128: one partial block per weight
)
def test_a_quantised_checkpoint_loads_dequantised(tmp_path, fp8_block, fp4_dtype):
    arch, original, out, fp8, fp4 = quantised_checkpoint(tmp_path, fp8_block, fp4_dtype)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
        "weight_block_size": list(fp8_block), "expert_dtype": "fp4",
    }
    stored = load_file(out / "model.safetensors")
    assert stored[next(iter(fp4))].dtype == fp4_dtype
    assert stored[next(iter(fp8)).removesuffix(".weight") + ".scale"].dtype == torch.float8_e8m0fnu

    ckpt = _SafetensorsCheckpoint(out)
    assert set(ckpt.file_of) == set(original)  # scales are part of their weights, not names
    assert all(ckpt.shape(name) == list(t.shape) for name, t in original.items())

    model = build_model(arch, attention_backend="torch")
    load_hf_weights(model, out)
    for name, loaded in iter_hf_weights(model):
        if name in fp8 or name in fp4:
            weight, scale = stored[name], stored[name.removesuffix(".weight") + ".scale"]
            assert torch.equal(loaded, quant.dequantize(weight, scale)), name
            block = fp8_block if name in fp8 else (1, 32)
            s = block_scales(scale, loaded.shape, block)
            err = (loaded - original[name]).abs()
            bound = torch.maximum(original[name].abs() * 2.0**-4, s * 2.0**-10) if name in fp8 else s
            assert (err <= bound).all(), name
        else:
            assert torch.equal(loaded, original[name]), name


def test_a_sharded_quantised_checkpoint_pairs_scales_across_shards(tmp_path):
    _, original, out, fp8, _ = quantised_checkpoint(tmp_path)
    stored = load_file(out / "model.safetensors")
    weight = sorted(fp8)[0]
    scale = weight.removesuffix(".weight") + ".scale"
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    first = {scale: stored.pop(scale)}  # the scale in one shard, its weight in the other
    save_file(first, str(sharded / "model-00001-of-00002.safetensors"))
    save_file(stored, str(sharded / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in stored}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (sharded / "config.json").write_text((out / "config.json").read_text())
    ckpt = _SafetensorsCheckpoint(sharded)
    assert scale not in ckpt.file_of and ckpt.scale_of[weight] == scale
    assert torch.equal(ckpt.tensor(weight), quant.dequantize(stored[weight], first[scale]))


def test_a_plain_checkpoint_keeps_its_own_scale_tensors(tmp_path):
    """Without quantisation, a model's own `.scale` parameter (no `.weight` beside it) is a tensor."""
    tensors = {"model.hc.scale": torch.ones(3), "model.hc.fn": torch.ones(2, 4), "lm.weight": torch.eye(4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = _SafetensorsCheckpoint(tmp_path)
    assert set(ckpt.file_of) == set(tensors) and not ckpt.scale_of
    assert ckpt.shape("model.hc.scale") == [3] and torch.equal(ckpt.tensor("lm.weight"), tensors["lm.weight"])


def rewrite(out, change):
    stored = load_file(out / "model.safetensors")
    change(stored)
    save_file(stored, str(out / "model.safetensors"))


def one_line_error(model, path, *names) -> str:
    with pytest.raises(MliteError) as err:
        load_hf_weights(model, path)
    message = str(err.value)
    assert "\n" not in message and all(f"'{name}'" in message for name in names), message
    return message


def test_a_scale_without_its_weight_is_one_line(tmp_path):
    arch, _, out, fp8, _ = quantised_checkpoint(tmp_path)
    weight = sorted(fp8)[0]
    rewrite(out, lambda stored: stored.pop(weight))
    model = build_model(arch, attention_backend="torch")
    assert "incomplete" in one_line_error(model, out, weight, weight[:-7] + ".scale")


def test_a_scale_grid_that_does_not_tile_its_weight_is_one_line(tmp_path):
    arch, original, out, fp8, fp4 = quantised_checkpoint(tmp_path)
    weight = "model.layers.0.self_attn.q_proj.weight"  # 16x16 blocks: a [4, 4] grid for 64x64
    assert list(original[weight].shape) == [64, 64]
    rewrite(out, lambda stored: stored.update({weight[:-7] + ".scale": e8m0(torch.full((3, 4), 127))}))
    model = build_model(arch, attention_backend="torch")
    message = one_line_error(model, out, weight, weight[:-7] + ".scale")
    assert "does not tile" in message and "[3, 4]" in message

    expert = sorted(fp4)[0]
    out2 = quantised_checkpoint(tmp_path / "second")[2]
    rewrite(out2, lambda stored: stored.update({expert[:-7] + ".scale": e8m0(torch.full((32, 3), 127))}))
    one_line_error(build_model(arch, attention_backend="torch"), out2, expert)
