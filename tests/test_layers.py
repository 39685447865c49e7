"""The package imports downward only, and the light layers stay light.

config -> plan -> runtime -> trainers -> integrations -> cli. A module may import its own layer or lower
ones, never a higher one. The runtime has sub-layers of its own: kernels, data and optim -> models -> loss
-> parallel -> ckpt -> layout, forward, state and the engine. So models know nothing of parallel code
(parallel code reaches them only through their declared seams). `mlite.config`, `mlite.plan` and
`mlite --help` never import torch or megatron.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mlite

ROOT = Path(mlite.__file__).parent

# Layer of each top-level unit; the longest matching prefix wins.
LAYERS = {
    "mlite": 0,
    "mlite.errors": 0,
    "mlite.config": 1,
    "mlite.stack": 1,
    "mlite.images": 1,
    "mlite.plan": 2,
    "mlite.runtime": 3,
    "mlite.runtime.kernels": 3.1,
    "mlite.runtime.data": 3.1,
    "mlite.runtime.optim": 3.1,
    "mlite.runtime.models": 3.2,
    "mlite.runtime.loss": 3.3,
    "mlite.runtime.parallel": 3.4,
    "mlite.runtime.ckpt": 3.5,
    "mlite.runtime.layout": 3.6,
    "mlite.runtime.forward": 3.6,
    "mlite.runtime.state": 3.6,
    "mlite.runtime.engine": 3.6,
    "mlite.trainers": 4,
    "mlite.bench": 4,
    "mlite.integrations": 5,
    "mlite.doctor": 5,
    "mlite.cli": 6,
    "mlite.__main__": 6,
}
HEAVY = ("torch", "megatron", "vllm", "verl", "transformers", "ray", "transformer_engine", "flash_attn")


def layer_of(module: str) -> float:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return LAYERS[best]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                yield node.lineno, ".".join(base + ([node.module] if node.module else []))
            elif node.module:
                yield node.lineno, node.module


def test_imports_point_downward():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        mine = layer_of(module_name(path))
        for line, target in imported_modules(path):
            if target.split(".")[0] != "mlite":
                continue
            if layer_of(target) > mine:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target} (a higher layer)")
    assert not wrong, "\n".join(wrong)


def test_light_layers_never_import_heavy_packages_at_module_level():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        if layer_of(module_name(path)) > 2:
            continue
        for line, target in imported_modules(path):
            if target.split(".")[0] in HEAVY:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_planner_and_cli_help_load_without_torch():
    code = (
        "import sys, mlite.config, mlite.plan, mlite.cli\n"
        "mlite.cli.build_parser()\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_layer_rule_catches_an_upward_import(tmp_path):
    # the checker itself must be able to fail: a config module importing the runtime is flagged
    assert layer_of("mlite.config.schema") < layer_of("mlite.runtime.models")
    assert layer_of("mlite.plan.memory") < layer_of("mlite.trainers.sft")
    # and inside the runtime: a model importing parallel code is flagged
    assert layer_of("mlite.runtime.models.moe") < layer_of("mlite.runtime.parallel.expert")
    assert layer_of("mlite.runtime.models.qwen3") < layer_of("mlite.runtime.parallel.parallelize")
    assert layer_of("mlite.runtime.parallel.pipeline") < layer_of("mlite.runtime.engine")


def test_models_are_changed_by_parallel_code_only_through_their_seams():
    """Parallel code never assigns onto a model's modules: no `layer.attn.core = ...`, `mlp.ep_group = ...`
    or replaced `forward`; it calls the seams the models declare (set_core, set_runner, set_parallel)."""
    wrong = []
    for path in sorted((ROOT / "runtime" / "parallel").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute):
                    wrong.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} "
                                 f"assigns {ast.unparse(target)}")
                if isinstance(target, ast.Attribute) and target.attr == "forward":
                    wrong.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} replaces a forward")
    assert not wrong, "\n".join(wrong)
