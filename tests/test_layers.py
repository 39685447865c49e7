"""The package imports downward only, without a circle, and the light layers stay light.

config -> plan -> runtime -> trainers -> integrations -> cli. A module may import its own layer or lower
ones, never a higher one. The runtime has sub-layers of its own: kernels and data -> optim -> models -> loss
-> parallel -> ckpt -> the optimizer backends (their shared base -> fsdp2 and dist_opt -> the factory that
picks one) -> layout, forward and state -> the engine. So models know nothing of parallel code (parallel code
reaches them only through their declared seams), and a backend knows nothing of the runtime that holds it.
No two modules import each other, directly or around a circle, however the import is written (at module
level, under `if TYPE_CHECKING:`, inside a function): a lower module that needs a higher one's type names a
small protocol of its own. `mlite.config`, `mlite.plan` and `mlite --help` never import torch or megatron.
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
    "mlite.images": 1,  # the pinned images: stacks and docker commands, torch-free
    "mlite.plan": 2,
    "mlite.runtime": 3,
    "mlite.runtime.kernels": 3.1,
    "mlite.runtime.data": 3.1,
    "mlite.runtime.optim": 3.15,  # the optimizer over the kernels' AdamW
    "mlite.runtime.models": 3.2,
    "mlite.runtime.loss": 3.3,
    "mlite.runtime.parallel": 3.4,
    "mlite.runtime.ckpt": 3.5,
    "mlite.runtime.fp8_match": 3.52,  # rounds like the rollout engine, with the weight sync's quantiser
    "mlite.runtime.backends.base": 3.55,  # the backend interface and the duties both backends share
    "mlite.runtime.backends.fsdp2": 3.56,
    "mlite.runtime.backends.dist_opt": 3.56,
    "mlite.runtime.backends": 3.57,  # the factory: optimizer.backend -> one of the two
    "mlite.runtime.layout": 3.6,
    "mlite.runtime.forward": 3.6,
    "mlite.runtime.state": 3.6,
    "mlite.runtime.engine": 3.7,
    "mlite.trainers": 4,
    "mlite.bench": 4,
    "mlite.integrations": 5,
    "mlite.images.doctor": 5,  # imports torch inside the checks that read the GPUs; only the CLI imports it
    "mlite.cli": 6,
    "mlite.__main__": 6,
}
HEAVY = ("torch", "megatron", "vllm", "verl", "transformers", "ray", "transformer_engine", "flash_attn")


def layer_of(module: str) -> float:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return LAYERS[best]


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
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


def import_graph(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """module -> {module of the same package it imports: where (path:line)}, over every import statement:
    at module level, under `if TYPE_CHECKING:` or inside a function alike (each one is an edge: a circle
    through a function-level import still ties the two modules together). `from pkg import name` imports
    the module pkg.name where there is one, else pkg."""
    modules = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph[name] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(target, f"{path.relative_to(root.parent)}:{node.lineno}")
    return graph


def import_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Circles of imports (their modules in import order, the first again at the end): in each strongly
    connected group of modules (Tarjan's algorithm), enough circles to pass through every one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    circles = []
    for group in groups:  # circles through each module of the group until every one is on a circle shown
        shown: set[str] = set()
        for module in sorted(group):
            if module not in shown:
                circles.append(_circle_through(graph, set(group), module))
                shown.update(circles[-1])
    return circles


def _circle_through(graph: dict[str, dict[str, str]], group: set[str], start: str) -> list[str]:
    """The shortest circle from `start` back to it inside `group` (breadth first)."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for target in sorted(graph[module]):
            if target == start:
                return paths[module] + [start]
            if target in group and target not in paths:
                paths[target] = paths[module] + [target]
                queue.append(target)
    raise AssertionError(f"{start}: no circle in its strongly connected group {sorted(group)}")


def describe(graph: dict[str, dict[str, str]], circle: list[str]) -> str:
    return " -> ".join(f"{a} ({graph[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


def test_no_import_circles():
    graph = import_graph()
    circles = import_cycles(graph)
    assert not circles, "import circles (break each: move the shared piece down a layer, or give the lower " \
        "module a protocol of its own):\n" + "\n".join(describe(graph, c) for c in circles)


def test_the_circle_check_sees_type_checking_and_function_level_imports(tmp_path):
    # the checker itself must be able to fail: a circle closed only under TYPE_CHECKING and inside a
    # function (the shape of engine <-> forward <-> state before the backends split) is found
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text("from pkg import forward, state\n")
    (package / "forward.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.engine import Runtime\n")
    (package / "state.py").write_text("def export():\n    from pkg.engine import Runtime\n")
    (package / "kernel.py").write_text("def fallback():\n    from pkg.optim import scale\n")
    (package / "optim.py").write_text("def step():\n    from pkg.kernel import fallback\n")
    graph = import_graph(package)
    circles = sorted(import_cycles(graph))
    assert circles == [["pkg.engine", "pkg.forward", "pkg.engine"], ["pkg.kernel", "pkg.optim", "pkg.kernel"],
                       ["pkg.state", "pkg.engine", "pkg.state"]]
    assert describe(graph, circles[0]) == "pkg.engine (pkg/engine.py:1) -> pkg.forward (pkg/forward.py:3) " \
        "-> pkg.engine"
    (package / "forward.py").write_text("")  # a lower module with no import of the engine: that circle goes
    (package / "state.py").write_text("")
    assert sorted(import_cycles(import_graph(package))) == [["pkg.kernel", "pkg.optim", "pkg.kernel"]]


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
    # the backends sit between the runtime's mechanisms and the runtime: above checkpoints and parallel code
    # (a backend owns checkpoint state and the rollout weight stream), below layout, forward, state and the
    # engine (a backend never reaches back into the runtime that holds it)
    assert layer_of("mlite.runtime.ckpt.sync") < layer_of("mlite.runtime.backends.base")
    assert layer_of("mlite.runtime.backends.base") < layer_of("mlite.runtime.backends.dist_opt")
    assert layer_of("mlite.runtime.backends.fsdp2") < layer_of("mlite.runtime.backends")
    assert layer_of("mlite.runtime.backends") < layer_of("mlite.runtime.state")
    assert layer_of("mlite.runtime.kernels.adamw") < layer_of("mlite.runtime.optim")


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
