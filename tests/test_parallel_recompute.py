"""Activation recompute: same gradients bit for bit, fewer activations kept between forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parallel_harness import make_batches, make_model

from mlite.errors import MliteError
from mlite.runtime.data.packed import IGNORE
from mlite.runtime.parallel.parallelize import apply_recompute


def grads_and_saved_bytes(moe: bool, **recompute):
    model = make_model(moe)
    apply_recompute(model, **recompute)
    batch = make_batches(1)[0]
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(batch)
        loss = F.cross_entropy(model.output(out.hidden), batch.labels, ignore_index=IGNORE) + out.aux_loss
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize(
    "recompute",
    [
        dict(granularity="selective"),
        dict(granularity="full", method="uniform", num_layers=1),
        dict(granularity="full", method="block", num_layers=2),
    ],
    ids=["selective", "full-uniform", "full-block2"],
)
def test_recompute_keeps_gradients_and_saves_memory(moe, recompute):
    base, base_bytes = grads_and_saved_bytes(moe, granularity="none")
    grads, saved_bytes = grads_and_saved_bytes(moe, **recompute)
    for name, grad in base.items():
        assert torch.equal(grads[name], grad), f"{name}: gradient changed under {recompute}"
    assert saved_bytes < base_bytes, f"{recompute} kept {saved_bytes} bytes, no recompute {base_bytes}"


def test_recomputing_every_layer_keeps_less_than_recomputing_the_first():
    every = grads_and_saved_bytes(False, granularity="full", method="uniform", num_layers=1)[1]
    first = grads_and_saved_bytes(False, granularity="full", method="block", num_layers=1)[1]
    assert every < first


def test_uniform_groups_of_several_layers_are_refused():
    with pytest.raises(MliteError, match="set recompute.num_layers: 1"):
        apply_recompute(make_model(False), granularity="full", method="uniform", num_layers=2)
