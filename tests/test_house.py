"""The package's architecture, read from its source with `ast` (in this process; nothing is
imported): no circle of imports between modules, imports that flow down the layer table, nothing
but the entry point importing the CLI, `parallel/` applying models without importing them, a
root that holds only the entry points and the shared leaves, a docstring atop every module, and
the whole `Config` handed only to the places that need all of it (`WHOLE_CONFIG`).

What counts as an import: every `import` and `from ... import` of a distrain module anywhere in
a module, at module level, inside a function or under `if TYPE_CHECKING`. A function-local
import still ties the two modules together (it only defers the tie to call time, and hides a
circle rather than removing it), so circles and layers count it too. One exception: importing
the package root itself (`import distrain`, for `__file__`) ties nothing, since
its `__init__` imports only the version leaf at module level (checked here) and runs before any
submodule anyway.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "distrain"
ROOT_FILES = {
    "__init__.py",
    "__main__.py",
    "cli.py",
    "errors.py",
    "files.py",
    "torch_compat.py",
    "version.py",
}

# Each component (a folder, or a root module) and its layer: a module may import from its own
# component or from one of a lower layer, never from the same layer or above. Derived from the
# code: the comment says what pulls a component above the layer below it.
LAYERS: dict[str, int] = {
    "errors": 0,  # the shared leaves: everyone's one-line errors and torch's API differences
    "version": 0,  # what records or prints the version imports it, not the package root
    "torch_compat": 1,  # its release checks read the version's torch range (version)
    "files": 1,  # writes that refuse planted symlinks raise a one-line error (errors)
    "config": 2,
    "family": 3,  # what a model family is to everyone else (its spec reads the [model] section)
    "observe": 3,  # logs, metrics and heartbeats read config (and write through files)
    "data": 4,  # the corpus reader logs through observe
    "parallel": 5,  # generic mechanisms over any model and the data's batches, beating the
    # heartbeat (observe)
    "checkpoint": 6,  # saves over parallel/device.py's checkpoint group
    "ft": 6,  # replica groups re-plan the loader (data) over torchft's process groups (parallel)
    "models": 7,  # each family owns its parallel plan (family/'s spec, parallel/'s styles); Hugging
    # Face folders are read through checkpoint/metadata.py's file-name confinement
    "launch": 7,  # preflight checks the data and the checkpoint folder before workers start
    "optim": 8,  # ZeRO-1 and 1-bit Adam communicate over parallel's meshes; tied weights
    "inference": 8,  # reads a run dir (launch/rundir.py), its checkpoint and its model family
    "interop": 8,  # exports from a run dir and its checkpoint through the family's mapping
    "layout": 9,  # the rule table reads model shapes, the optimizer's capability, mesh degrees
    "evaluate": 9,  # lm-evaluation-harness over interop/'s checkpoint loading, inference's sampler
    "plan": 10,  # checks layouts with layout/ and builds their optimizers (optim/)
    "train": 11,
    "distrain": 12,  # the package root's Python API (function-local imports of config and train)
    "cli": 12,
    "__main__": 13,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES: dict[str, ast.Module] = {name: ast.parse(p.read_text()) for name, p in MODULES.items()}


def _imported(name: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The distrain modules `node` (in module `name`) imports."""
    if isinstance(node, ast.Import):
        # `import distrain` (the root, for `__version__`) ties nothing: see the docstring.
        return {a.name for a in node.names if a.name in MODULES and a.name != "distrain"}
    base = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    if node.level == 0:
        module = node.module or ""
    else:
        module = ".".join(filter(None, [base, node.module]))
    found = {module} if module in MODULES else set()
    return found | {f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in MODULES}


def _imports(*, module_level_only: bool = False) -> dict[str, set[str]]:
    """Module -> the distrain modules it imports, without itself."""
    graph = {}
    for name, tree in TREES.items():
        nodes = tree.body if module_level_only else ast.walk(tree)
        found: set[str] = set()
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found |= _imported(name, node)
        graph[name] = found - {name}
    return graph


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def _upward_imports() -> set[tuple[str, str]]:
    return {
        (a, b)
        for a, targets in _imports().items()
        for b in targets
        if _component(a) != _component(b) and LAYERS[_component(b)] >= LAYERS[_component(a)]
    }


def test_no_circle_of_imports_between_modules():
    assert _circles(_imports()) == []


def test_the_package_root_imports_only_the_version_leaf_at_module_level():
    # The root binds names, and refuses a torch outside the range (version.py, a leaf that
    # imports nothing of distrain): importing it ties no component to another.
    assert _imports(module_level_only=True)["distrain"] <= {"distrain.version"}
    assert _imports()["distrain.version"] == set()


def test_every_component_has_a_layer():
    components = {_component(m) for m in MODULES}
    assert components == set(LAYERS), "place a new component in LAYERS"


def test_imports_flow_down_the_layers():
    assert sorted(_upward_imports()) == [], "an import up or across the layer table (LAYERS)"


def test_nothing_but_the_entry_point_imports_the_cli():
    importers = sorted(m for m, targets in _imports().items() if "distrain.cli" in targets)
    assert importers == ["distrain.__main__"]


def test_parallel_imports_no_model():
    found = sorted(
        (m, t)
        for m, targets in _imports().items()
        if _component(m) == "parallel"
        for t in targets
        if _component(t) == "models"
    )
    assert found == []


def test_only_the_registry_names_a_model_family():
    """Every consumer of a model (layout rules, trainer, optimizer, planner, export, generation,
    evaluation, the CLI) asks the family's spec through the registry; none imports a family's
    folder, so adding a family edits nothing outside models/."""
    generic = {"distrain.models.registry", "distrain.models.hf_files"}
    found = sorted(
        (m, t)
        for m, targets in _imports().items()
        if _component(m) != "models"
        for t in targets
        if _component(t) == "models" and t not in generic
    )
    assert found == []


def test_the_package_root_holds_only_entry_points_and_leaves():
    assert {p.name for p in PACKAGE.glob("*.py")} == ROOT_FILES
    folders = [p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert [p.name for p in folders if not (p / "__init__.py").exists()] == []


def test_every_module_says_what_it_owns():
    assert [m for m, tree in TREES.items() if not ast.get_docstring(tree)] == []


# Where the whole `Config` may be handed on: the config's own functions, the entry points that
# receive the user's config (the worker, `train --check`, the preflight checks, `resolve`), the
# layout rules that read every section, the run's plan made from it, and the planner, which
# prices variants of a whole config. Every other component takes its section or the `RunPlan`.
WHOLE_CONFIG = {
    "distrain.cli": {"_check"},
    "distrain.config.io": {"set_field", "write_toml"},
    "distrain.launch.preflight": {"preflight"},
    "distrain.layout.facts": {"Facts"},
    "distrain.layout.rules": {"validate"},
    "distrain.parallel.run_plan": {"RunPlan", "RunPlan.decided"},
    "distrain.plan.memory_model": {"calibration_builds"},
    "distrain.plan.planned": {"planned_run"},
    "distrain.plan.search": {"candidate_plan", "plan", "timed_layouts"},
    "distrain.train.resolve": {"resolve"},
    "distrain.train.worker": {"run_training"},
}


def _takes_the_whole_config(tree: ast.Module) -> set[str]:
    """The functions with a parameter, and the classes with a field, annotated `Config`."""
    found = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                if any(p.annotation and ast.unparse(p.annotation) == "Config" for p in params):
                    found.add(prefix + child.name)
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                fields = [s for s in child.body if isinstance(s, ast.AnnAssign)]
                if any(ast.unparse(f.annotation) == "Config" for f in fields):
                    found.add(prefix + child.name)
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def test_components_take_their_section_or_the_plan_not_the_whole_config():
    found = {
        name: takers for name, tree in TREES.items() if (takers := _takes_the_whole_config(tree))
    }
    assert found == WHOLE_CONFIG
    assert sum(map(len, found.values())) <= 15
