"""torchtitan's private names that `mlite bench --titan` relies on (mlite/bench/titan_side.py), in one place.
Checked against torchtitan 0.3.0 (`TITAN_CHECKED`); torchtitan is imported inside the functions only (it is
not a dependency of mlite). Its Qwen3 registry builds its flavors from module-private layer builders and
init configs, and its chunked loss runs the LM head itself once the model is told to skip it."""

from __future__ import annotations

from types import SimpleNamespace

TITAN_CHECKED = "0.3.0"


def qwen3_parts() -> SimpleNamespace:
    """The pieces torchtitan's Qwen3 registry (torchtitan/models/qwen3/__init__.py) builds its flavors from:
    the dense and MoE layer builders, the norm, and the embedding / linear init configs."""
    from torchtitan.models import qwen3

    return SimpleNamespace(build_layers=qwen3._build_qwen3_layers,
                           build_moe_layers=qwen3._build_qwen3_moe_layers, norm=qwen3._qwen3_norm,
                           embedding_init=qwen3._EMBEDDING_INIT,
                           embedding_skip_init=qwen3._EMBEDDING_SKIP_INIT, linear_init=qwen3._LINEAR_INIT)


def skip_lm_head(model) -> None:
    """The model's forward stops before its LM head, which torchtitan's ChunkedLossWrapper applies per chunk
    (the flag its trainer sets)."""
    model._skip_lm_head = True
