"""The loss knows no model family: each model declares its LM head through `CausalLM.loss_head`
(mlite.runtime.models.base), and mlite.runtime.loss reads only that seam."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import mlite.runtime.loss as loss
from mlite.config.catalog import preset_arch
from mlite.runtime.models import build_model
from mlite.runtime.models.base import CausalLM, LossHead, loss_head_of


def test_the_loss_imports_no_model_family_and_reads_no_model_attribute():
    tree = ast.parse(Path(loss.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    models = {m for m in imported if m and m.startswith("mlite.runtime.models")}
    assert models == {"mlite.runtime.models.base"}, models
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    model_attributes = read & {"__self__", "__func__", "mtp", "embed", "output"}
    assert not model_attributes, f"mlite/runtime/loss.py reads {model_attributes}: ask the model's loss_head"


def test_models_declare_their_head_the_embedding_and_whether_their_forward_reads_it():
    torch.manual_seed(0)
    qwen = build_model(preset_arch("tiny-qwen3"), attention_backend="torch")
    v4 = build_model(preset_arch("tiny-deepseek-v4"), mtp_weight=1.0)
    v4_plain = build_model(preset_arch("tiny-deepseek-v4"))
    for model, reads in ((qwen, False), (v4, True), (v4_plain, False)):
        assert isinstance(model, CausalLM)
        declared = LossHead(model.output, model.embed, read_in_forward=reads)
        assert loss_head_of(model.compute_logits) == declared
    assert loss_head_of(qwen.output) is None  # a module handed over alone: no model declares it
    assert loss_head_of(lambda h: qwen.output(h)) is None
    qwen.output = None  # a stage without the head (pipeline parallel) declares none
    assert qwen.loss_head() is None
