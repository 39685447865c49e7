"""Write the DeepSeek-V4 reference fixture (tests/fixtures/dsv4) with transformers' own `models/deepseek_v4`.

RUNS ONLY IN A SIDE ENVIRONMENT with transformers==5.23.0, torch==2.13.0 (CPU) and safetensors: the main
venv's transformers (5.10) has an older DeepSeek-V4 (its RMSNorm casts to the input dtype before the fp32
weight multiply), not the pinned reference. It must not import mlite (tests/test_dsv4_reference.py runs it
in a fresh venv that has no mlite). Usage:

    /path/to/side-venv/bin/python scripts/dsv4_reference.py [OUT_DIR]     # default tests/fixtures/dsv4

For each case it writes OUT_DIR/<case>/:
  config.json, model.safetensors   `save_pretrained(..., safe_serialization=True)`: the on-disk names are
                                   what transformers' save-time conversion writes (DeepSeek's `attn.wq_a`,
                                   `ffn.experts.<e>.w1`, `hc_attn_fn`, ... under a `model.` prefix)
  reference.safetensors            input_ids.{i} int64 [L_i]; logits.{i} fp32 [L_i, V]; aux_loss.{i} fp32 [];
                                   ce_loss fp32 []; grad.<on-disk name> fp32 for every parameter

Each of the three sequences runs alone (batch 1, no attention mask, default position ids) through
`DeepseekV4ForCausalLM` in train mode with `output_router_logits=True`, fp32 on CPU, eager attention and the
default experts implementation. `aux_loss.{i}` is the model's `aux_loss` output for sequence i
(load_balancing_loss_func over the top-k routers' logits, not multiplied by router_aux_loss_coef).
`ce_loss` = sum over sequences of the summed next-token CE (logits[:-1] vs input_ids[1:]) / number of
predicted tokens; `grad.*` are the gradients of `ce_loss` alone (no aux loss), zeros where autograd gives
None (the Lightning Indexer, which only feeds a top-k). Non-parameter buffers (`tid2eid`, the router's
`gate.bias`) have no `grad.` entry.

Weights: every parameter and persistent buffer is drawn here from a seeded generator, including those
transformers initialises to a constant (attention sinks, compressor/indexer `position_bias`, mHC
base/scale, hc_head base/scale, router `e_score_correction_bias`, the hash table `tid2eid`, RMSNorm
weights). Projections get std 1/sqrt(fan_in) so activations stay of order 1; the routed and shared experts'
gate/up get std 1.4, so their SwiGLU clamp (`swiglu_limit`) is hit. The indexer's query heads come in
sign-flipped pairs (see `randomise`) so index scores have no exact ties, and each case's seed is one where
every router / indexer top-k pick beats its runner-up by MIN_TOPK_MARGIN and every expert gets tokens
(asserted). Diagnostics (clamped fractions, top-k margins, expert load, None grads, the other experts
implementations' differences, a from_pretrained round trip) go to stdout only.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

TRANSFORMERS_VERSION = "5.23.0"
TORCH_VERSION = "2.13.0"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dsv4"
SEQ_LENS = (45, 29, 7)

# Small enough that the committed fixture (both cases) stays well under 1 MB (about 660 KB), with every
# feature still covered: partial rope in attention and the indexer (rope dim 8 of 16), grouped low-rank
# output, all three attention kinds, hash and bias routing, the SwiGLU clamp, mHC with 4 copies.
BASE = dict(
    vocab_size=64,
    hidden_size=16,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    partial_rotary_factor=0.5,  # rope dim 8
    q_lora_rank=8,
    o_groups=2,
    o_lora_rank=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=4,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=3,
    sliding_window=8,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    num_nextn_predict_layers=0,
    max_position_embeddings=256,
    router_aux_loss_coef=0.01,
    swiglu_limit=10.0,
    routed_scaling_factor=1.5,
    scoring_func="sqrtsoftplus",
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
)

YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1)

# name -> (config kwargs, seed)
# seeds picked so that every top-k pick beats its runner-up by >= MIN_TOPK_MARGIN and every expert gets tokens
CASES = {
    "tiny": (BASE, 7),
    "tiny-yarn": (
        BASE
        | dict(
            # a flat rope dict: DeepseekV4Config folds it into rope_parameters["compress"] (CSA/HCA layers and
            # their compressors/indexers) and keeps rope_parameters["main"] (sliding layers) default
            rope_parameters=dict(YARN),
            layer_types=[
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "sliding_attention",
                "heavily_compressed_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            o_groups=4,
        ),
        11,
    ),
}

# routed and shared experts' gate/up: pre-activations ~N(0, 5.6^2) (hidden 16) cross the clamp of 10
EXPERT_GATE_UP_STD = 1.4
EXPERT_DOWN_STD = 0.02
EMBED_STD = 1.0
MIN_TOPK_MARGIN = 1e-4  # every router / indexer top-k pick must beat the runner-up by this much


def check_versions() -> None:
    got = (transformers.__version__, torch.__version__.split("+")[0])
    if got != (TRANSFORMERS_VERSION, TORCH_VERSION):
        raise SystemExit(
            f"needs transformers=={TRANSFORMERS_VERSION} and torch=={TORCH_VERSION}, found {got}: "
            "run this in the side environment (see the module docstring)"
        )


def build_config(kwargs: dict) -> DeepseekV4Config:
    config = DeepseekV4Config(**copy.deepcopy(kwargs), attn_implementation="eager")
    rope = config.rope_parameters
    assert set(rope) == {"main", "compress"}, rope
    assert rope["main"]["rope_type"] == "default" and rope["main"]["rope_theta"] == kwargs["rope_theta"], rope
    assert rope["compress"]["rope_theta"] == kwargs["compress_rope_theta"], rope
    want_compress = (kwargs.get("rope_parameters") or {}).get("rope_type", "default")
    assert rope["compress"]["rope_type"] == want_compress, rope
    assert config.qk_rope_head_dim == 8
    return config


def normal_(t: torch.Tensor, std: float, gen: torch.Generator, mean: float = 0.0) -> None:
    t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean)


COMPRESSORS = (dsv4.DeepseekV4CSACompressor, dsv4.DeepseekV4HCACompressor, dsv4.DeepseekV4Indexer)


@torch.no_grad()
def randomise(model: DeepseekV4ForCausalLM, gen: torch.Generator) -> None:
    """Give every tensor transformers initialises to a constant a random value, and raise some stds."""
    config = model.config
    for name, module in model.named_modules():
        if isinstance(module, dsv4.DeepseekV4RMSNorm):
            normal_(module.weight, 0.1, gen, mean=1.0)
        elif isinstance(module, dsv4.DeepseekV4Attention):
            normal_(module.sinks, 0.5, gen)
        elif isinstance(module, COMPRESSORS):
            normal_(module.position_bias, 0.5, gen)
        elif isinstance(module, dsv4.DeepseekV4HyperConnection):
            normal_(module.fn, 1 / math.sqrt(module.fn.shape[1]), gen)  # mixes ~N(0, 1) before the scale
            normal_(module.base, 0.5, gen)
            module.scale.copy_(0.5 + torch.rand(module.scale.shape, generator=gen))
        elif isinstance(module, dsv4.DeepseekV4HyperHead):
            normal_(module.hc_fn, 1 / math.sqrt(module.hc_fn.shape[1]), gen)
            normal_(module.hc_base, 0.5, gen)
            module.hc_scale.copy_(0.5 + torch.rand(module.hc_scale.shape, generator=gen))
        elif isinstance(module, dsv4.DeepseekV4TopKRouter):
            normal_(module.weight, 1 / math.sqrt(config.hidden_size), gen)  # logits ~N(0, 1)
            normal_(module.e_score_correction_bias, 0.1, gen)
        elif isinstance(module, dsv4.DeepseekV4HashRouter):
            normal_(module.weight, 1 / math.sqrt(config.hidden_size), gen)
            # distinct expert ids within a row, in [0, n_routed_experts)
            order = torch.rand((config.vocab_size, config.n_routed_experts), generator=gen).argsort(dim=-1)
            module.tid2eid.copy_(order[:, : config.num_experts_per_tok])
        elif isinstance(module, dsv4.DeepseekV4Experts):
            normal_(module.gate_up_proj, EXPERT_GATE_UP_STD, gen)
            normal_(module.down_proj, EXPERT_DOWN_STD, gen)
        elif isinstance(module, dsv4.DeepseekV4MLP):  # the shared expert
            normal_(module.gate_proj.weight, EXPERT_GATE_UP_STD, gen)
            normal_(module.up_proj.weight, EXPERT_GATE_UP_STD, gen)
            normal_(module.down_proj.weight, EXPERT_DOWN_STD, gen)
        elif isinstance(module, torch.nn.Linear) and ".shared_experts." not in name:
            # every other projection (incl. the grouped o_a_proj) keeps the scale of its input, so the
            # attention output, the indexer scores, the compressor gates and the logits are all of order 1
            normal_(module.weight, 1 / math.sqrt(module.weight.shape[1]), gen)
        elif isinstance(module, torch.nn.Embedding):
            normal_(module.weight, EMBED_STD, gen)
    for module in model.modules():
        if isinstance(module, dsv4.DeepseekV4Indexer):
            # pair the indexer heads, head 2j+1's query = -(head 2j's): an index score is
            # sum_h w_h * ReLU(q_h . k), and with independent heads a quarter of the entries (2 heads) would
            # score exactly 0, so the top-k would break exact ties (implementation-defined). With paired
            # heads exactly one ReLU of a pair is positive and scores are continuous (see topk_margins).
            w = module.q_b_proj.weight.view(module.num_heads // 2, 2, module.head_dim, -1)
            w[:, 1] = -w[:, 0]


def make_inputs(vocab: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int64) for n in SEQ_LENS]


def forward_all(model: DeepseekV4ForCausalLM, seqs: list[torch.Tensor]) -> tuple[list, list, torch.Tensor]:
    """Logits and aux_loss of each sequence alone, and the token-mean next-token CE over all of them."""
    logits, aux, ce_sum = [], [], 0.0
    n_pred = sum(len(s) - 1 for s in seqs)
    for ids in seqs:
        out = model(input_ids=ids[None], output_router_logits=True, use_cache=False)
        lg = out.logits[0]
        logits.append(lg)
        aux.append(out.aux_loss)
        ce_sum = ce_sum + F.cross_entropy(lg[:-1], ids[1:], reduction="sum")
    return logits, aux, ce_sum / n_pred


def save_and_read(model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        return load_file(str(Path(tmp) / "model.safetensors"))


def persistent_buffer_disk_keys(model: DeepseekV4ForCausalLM) -> set[str]:
    """On-disk names of the persistent buffers: save with every parameter NaN, keep the non-NaN entries."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.fill_(float("nan"))
    return {k for k, v in save_and_read(twin).items() if not (v.is_floating_point() and v.isnan().all())}


def grads_by_disk_name(model: DeepseekV4ForCausalLM, buffer_keys: set[str]) -> dict[str, torch.Tensor]:
    """Each parameter's .grad under the name save_pretrained writes it (zeros where the grad is None)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for (_, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
            q.data = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
    return {f"grad.{k}": v for k, v in save_and_read(twin).items() if k not in buffer_keys}


# ---------------------------------------------------------------- diagnostics (stdout only)


@torch.no_grad()
def clamp_stats(model: DeepseekV4ForCausalLM, seqs: list[torch.Tensor]) -> dict:
    limit = model.config.swiglu_limit
    counts = {"routed": [0, 0, 0], "shared": [0, 0, 0]}  # [gate > limit, |up| > limit, elements of each]

    def count(kind: str, gate: torch.Tensor, up: torch.Tensor) -> None:
        c = counts[kind]
        c[0] += int((gate > limit).sum())
        c[1] += int((up.abs() > limit).sum())
        c[2] += gate.numel()

    patched = []
    for module in model.modules():
        if isinstance(module, dsv4.DeepseekV4Experts):
            orig = module._apply_gate

            def wrapped(gate_up, _orig=orig):
                gate, up = gate_up.chunk(2, dim=-1)
                count("routed", gate, up)
                return _orig(gate_up)

            module._apply_gate = wrapped
            patched.append(module)
        elif isinstance(module, dsv4.DeepseekV4MLP):
            orig_fwd = module.forward

            def fwd(x, _m=module, _orig=orig_fwd):
                count("shared", _m.gate_proj(x), _m.up_proj(x))
                return _orig(x)

            module.forward = fwd
            patched.append(module)
    for ids in seqs:
        model(input_ids=ids[None], use_cache=False)
    for module in patched:
        module.__dict__.pop("_apply_gate", None)
        module.__dict__.pop("forward", None)
    out = {}
    for kind, (g, u, n) in counts.items():
        out[kind] = {"gate>limit": g / n, "|up|>limit": u / n, "either_of_2n": (g + u) / (2 * n), "n": n}
    return out


@torch.no_grad()
def topk_margins(model: DeepseekV4ForCausalLM, seqs: list[torch.Tensor]) -> dict:
    """Smallest gap between the k-th and (k+1)-th candidate of every top-k pick (0 would be a tie)."""
    margins = {"router": math.inf, "indexer": math.inf}
    k_router, k_index = model.config.num_experts_per_tok, model.config.index_topk
    rate = model.config.compress_rates["compressed_sparse_attention"]
    hooks = []

    def router_hook(module, args, out):
        logits = out[0]
        sel = (module.score_fn(logits) + module.e_score_correction_bias).sort(dim=-1, descending=True).values
        margins["router"] = min(margins["router"], float((sel[:, k_router - 1] - sel[:, k_router]).min()))

    def scorer_hook(module, args, out):
        scores = out[0]  # [S, T]
        seq_len, comp_len = scores.shape
        for t in range(seq_len):
            valid = min((t + 1) // rate, comp_len)
            if valid > k_index:
                s = scores[t, :valid].sort(descending=True).values
                margins["indexer"] = min(margins["indexer"], float(s[k_index - 1] - s[k_index]))

    for module in model.modules():
        if isinstance(module, dsv4.DeepseekV4TopKRouter):
            hooks.append(module.register_forward_hook(router_hook))
        elif isinstance(module, dsv4.DeepseekV4IndexerScorer):
            hooks.append(module.register_forward_hook(scorer_hook))
    for ids in seqs:
        model(input_ids=ids[None], use_cache=False)
    for h in hooks:
        h.remove()
    return margins


@torch.no_grad()
def expert_load(model: DeepseekV4ForCausalLM, seqs: list[torch.Tensor]) -> list[list[int]]:
    """Tokens routed to each expert, per layer, over all sequences."""
    n = model.config.n_routed_experts
    loads = {}

    def hook(experts, args, out):
        idx = args[1]
        loads[id(experts)] = loads.get(id(experts), 0) + torch.bincount(idx.reshape(-1), minlength=n)

    mods = [m for m in model.modules() if isinstance(m, dsv4.DeepseekV4Experts)]
    hooks = [m.register_forward_hook(hook) for m in mods]
    for ids in seqs:
        model(input_ids=ids[None], use_cache=False)
    for h in hooks:
        h.remove()
    return [loads[id(m)].tolist() for m in mods]


def experts_impl_crosscheck(model: DeepseekV4ForCausalLM, seqs, logits, aux, ce) -> dict:
    """Re-run with each other experts implementation: max abs difference to the default's numbers."""
    res = {}
    for impl in ("eager", "batched_mm", "grouped_mm"):
        if impl == model.config._experts_implementation:
            continue
        twin = copy.deepcopy(model)
        twin.set_experts_implementation(impl)
        twin.zero_grad(set_to_none=True)
        lg2, aux2, ce2 = forward_all(twin, seqs)
        ce2.backward()
        gmax = 0.0
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            a = p.grad if p.grad is not None else torch.zeros_like(p)
            b = q.grad if q.grad is not None else torch.zeros_like(q)
            gmax = max(gmax, float((a - b).abs().max()))
        res[impl] = {
            "logits": max((a - b).abs().max().item() for a, b in zip(logits, lg2, strict=True)),
            "aux": max((a - b).abs().item() for a, b in zip(aux, aux2, strict=True)),
            "ce": (ce - ce2).abs().item(),
            "grads": gmax,
        }
    return res


def roundtrip_check(case_dir: Path, model: DeepseekV4ForCausalLM, seqs, logits) -> None:
    """from_pretrained of what was written gives back every tensor and the same logits."""
    loaded = DeepseekV4ForCausalLM.from_pretrained(case_dir, attn_implementation="eager", dtype=torch.float32)
    loaded.train()
    ref_sd, got_sd = model.state_dict(), loaded.state_dict()
    assert ref_sd.keys() == got_sd.keys()
    for k in ref_sd:
        assert torch.equal(ref_sd[k], got_sd[k]), f"round trip changed {k}"
    with torch.no_grad():
        for ids, lg in zip(seqs, logits, strict=True):
            got = loaded(input_ids=ids[None], use_cache=False).logits[0]
            assert torch.equal(got, lg), "round trip changed the logits"


# ---------------------------------------------------------------- main


def run_case(name: str, out_dir: Path) -> dict:
    kwargs, seed = CASES[name]
    config = build_config(kwargs)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    seqs = make_inputs(config.vocab_size, seed)
    randomise(model, torch.Generator().manual_seed(seed))
    model.train()
    margins = topk_margins(model, seqs)
    assert min(margins.values()) >= MIN_TOPK_MARGIN, f"{name}: a top-k pick is (nearly) tied: {margins}"
    load = expert_load(model, seqs)
    assert min(min(row) for row in load) > 0, f"{name}: an expert gets no token: {load}"
    assert model.config._attn_implementation == "eager"

    case_dir = out_dir / name
    case_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(case_dir, safe_serialization=True)
    (case_dir / "generation_config.json").unlink(missing_ok=True)  # not part of the fixture

    model.zero_grad(set_to_none=True)
    logits, aux, ce = forward_all(model, seqs)
    ce.backward()
    for t in [*logits, *aux, ce]:
        assert torch.isfinite(t).all()

    buffer_keys = persistent_buffer_disk_keys(model)
    grads = grads_by_disk_name(model, buffer_keys)
    none_grads = [n for n, p in model.named_parameters() if p.grad is None]

    ref: dict[str, torch.Tensor] = {}
    for i, (ids, lg, a) in enumerate(zip(seqs, logits, aux, strict=True)):
        ref[f"input_ids.{i}"] = ids.clone()
        ref[f"logits.{i}"] = lg.detach().clone()
        ref[f"aux_loss.{i}"] = a.detach().clone().reshape(())
    ref["ce_loss"] = ce.detach().clone().reshape(())
    ref |= grads
    save_file({k: v.contiguous() for k, v in ref.items()}, str(case_dir / "reference.safetensors"))

    disk = load_file(str(case_dir / "model.safetensors"))
    assert {k for k in disk if k not in buffer_keys} == {k[len("grad.") :] for k in grads}

    roundtrip_check(case_dir, model, seqs, logits)
    return {
        "case": name,
        "experts_implementation": model.config._experts_implementation,
        "rope_parameters": model.config.rope_parameters,
        "compress_inv_freq": model.model.rotary_emb.compress_inv_freq.tolist(),
        "main_inv_freq": model.model.rotary_emb.main_inv_freq.tolist(),
        "ce_loss": ce.item(),
        "aux_loss": [a.item() for a in aux],
        "buffers_on_disk": sorted(buffer_keys),
        "none_grads": none_grads,
        "clamped": clamp_stats(model, seqs),
        "topk_margins": margins,
        "expert_load": load,
        "experts_impl_max_abs_diff": experts_impl_crosscheck(model, seqs, logits, aux, ce),
    }


def main(argv: list[str]) -> None:
    check_versions()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out_dir = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT
    for name in CASES:
        print(json.dumps(run_case(name, out_dir), indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv)
