"""Rules of the house that keep the layers apart."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import re
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import stalebound

CORE = Path(stalebound.__file__).parent / "core"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_core_imports_only_the_standard_library_and_itself() -> None:
    forbidden_std = {
        "threading",
        "asyncio",
        "time",
        "socket",
        "multiprocessing",
        "subprocess",
        "os",
    }
    offenders = {}
    for path in CORE.glob("*.py"):
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top == "stalebound":
                allowed = name == "stalebound.core" or name.startswith("stalebound.core.")
            else:
                allowed = top in sys.stdlib_module_names and top not in forbidden_std
            if not allowed:
                offenders[path.name] = name
    assert offenders == {}


def test_import_stalebound_loads_no_heavy_modules() -> None:
    heavy = ["torch", "ray", "numpy", "transformers", "httpx", "matplotlib", "omegaconf", "yaml"]
    code = f"import sys, stalebound; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names_are_exported() -> None:
    for name in ["StalenessBuffer", "BufferState", "EntryState", "ProtocolError", "ConfigError"]:
        assert name in stalebound.__all__
        assert getattr(stalebound, name) is not None
    assert [m.name for m in stalebound.BufferState] == [
        "PENDING",
        "STUCK",
        "READY_WITH_CAPACITY",
        "READY",
    ]
    assert [m.name for m in stalebound.EntryState] == ["EMPTY", "RESERVED", "OCCUPIED"]
    assert issubclass(stalebound.ConfigError, stalebound.StaleboundError)
    assert issubclass(stalebound.ProtocolError, stalebound.StaleboundError)
    assert issubclass(stalebound.InvariantError, stalebound.StaleboundError)


def imported_names(path: Path) -> set[str]:
    """``module.name`` for every ``from module import name`` (and ``module`` for ``import``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


# The core's decision makers: a driver talks to them only through the Coordinator.
DECIDERS = {
    "BufferPolicy",
    "CapacityPolicy",
    "StalenessBuffer",
    "GroupTracker",
    "StragglerClock",
    "StuckTimer",
    "proactive_filter_targets",
    "eligible_targets",
    "get_group_post_process",
    "move",
}


def test_drivers_decide_nothing_themselves() -> None:
    """The executor's runtime, the Ray backend and the simulator reach staleness decisions only
    through the coordinator (AReaL's StalenessManager wraps the capacity arithmetic, as AReaL's
    does)."""
    root = CORE.parent
    offenders = {}
    for path in (
        p for layer in ("runtime", "distributed", "sim") for p in (root / layer).glob("*.py")
    ):
        for name in imported_names(path):
            if name.startswith("stalebound.core") and name.rsplit(".", 1)[-1] in DECIDERS:
                offenders[f"{path.parent.name}/{path.name}"] = name
    assert offenders == {}
    assert len((root / "runtime" / "executor.py").read_text().splitlines()) <= 720


def test_training_and_observability_do_not_import_the_simulator() -> None:
    # the trace format lives in obs/, so a training run does not load the simulator
    root = Path(stalebound.__file__).parent
    offenders = {
        str(path.relative_to(root)): name
        for layer in ("train", "obs")
        for path in (root / layer).glob("*.py")
        for name in imported_modules(path)  # function-level imports included
        if name == "stalebound.sim" or name.startswith("stalebound.sim.")
    }
    assert offenders == {}


def _loaded_after(statement: str, prefixes: tuple[str, ...]) -> list[str]:
    code = (
        f"import sys; {statement}; "
        f"print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded: list[str] = ast.literal_eval(out.stdout.strip())
    return loaded


def test_loading_the_runtime_loads_no_task_and_no_trainer() -> None:
    # the executor's settings live next to it, not in the whole config tree
    loaded = _loaded_after(
        "import stalebound.runtime", ("stalebound.tasks", "stalebound.train", "stalebound.config")
    )
    assert loaded == []


def test_the_simulators_cohort_model_shares_the_engines_rule_without_torch() -> None:
    # the merge rule sits beside the engine that uses it, in a module the simulator can load
    loaded = _loaded_after("import stalebound.sim.cohorts", ("torch", "stalebound.engines.cohorts"))
    assert loaded == ["stalebound.engines.cohorts"]


def test_the_config_tree_composes_sections_without_loading_tasks_or_torch() -> None:
    loaded = _loaded_after(
        "import stalebound.config",
        (
            "stalebound.tasks.arithmetic",
            "stalebound.tasks.strings",
            "stalebound.tasks.calculator",
            "stalebound.tasks.workflow",
            "stalebound.train.trainer",
            "torch",
        ),
    )
    assert loaded == []


def test_task_base_and_workflow_do_not_import_each_other() -> None:
    tasks = Path(stalebound.__file__).parent / "tasks"
    assert "stalebound.tasks.workflow" in imported_modules(tasks / "base.py")
    assert "stalebound.tasks.base" not in imported_modules(tasks / "workflow.py")


# -- the import graph --------------------------------------------------------------------------------
#
# Nodes are the package's modules; an edge is one import statement, resolved to the most specific
# module it names (``from stalebound.tasks import base`` → ``stalebound.tasks.base``; ``from
# stalebound.core import Coordinator`` → ``stalebound.core``). Typing-only imports (under ``if
# TYPE_CHECKING:``) count: a module that names another's types depends on it.

SRC = CORE.parent.parent


def _module_paths() -> dict[str, Path]:
    paths = {}
    for path in (SRC / "stalebound").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        paths[".".join(parts)] = path
    return paths


MODULES = _module_paths()


def _resolve(name: str) -> str | None:
    """The most specific module of the package that ``name`` (dotted) lies in, if any."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def _targets(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.level == 0 and node.module:
        named = [f"{node.module}.{alias.name}" for alias in node.names]
        # ``from package import submodule``: the submodule; ``from module import name``: the module
        names = [n if n in MODULES else node.module for n in named]
    else:  # the package writes no relative imports
        raise AssertionError(f"a relative import at line {node.lineno}")
    return {t for t in map(_resolve, names) if t is not None}


def _imports(module: str, *, nested: bool) -> dict[str, int]:
    """The package's modules that ``module`` imports (each with the line of its first import):
    with ``nested``, also those imported inside functions and classes."""
    found: dict[str, int] = {}

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(node):
                    if target != module:
                        found.setdefault(target, node.lineno)
            elif nested or isinstance(node, ast.If | ast.Try | ast.With):
                # module-level blocks (``if TYPE_CHECKING:``, ``try: ... except ImportError:``)
                # are module level; with ``nested``, every body below
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child])
                    elif isinstance(child, ast.excepthandler):
                        visit(child.body)

    visit(ast.parse(MODULES[module].read_text()).body)
    return found


def _graph(*, nested: bool) -> dict[str, dict[str, int]]:
    return {module: _imports(module, nested=nested) for module in MODULES}


def _reach(graph: dict[str, dict[str, int]], start: str) -> dict[str, str]:
    """Every module ``start`` leads to, each with the module it is first reached from (a
    breadth-first search, so following them back gives a shortest chain)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    return came_from


def _circles(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each set of modules that import each other round a circle, once: its modules, and the
    shortest circle through the first of them as ``a → b (line 7) → a (line 12)``."""
    reach = {module: _reach(graph, module) for module in graph}
    seen: set[str] = set()
    circles = []
    for start in sorted(graph):
        if start in seen or start not in reach[start]:
            continue
        members = sorted(m for m in reach[start] if start in reach[m])
        seen.update(members)
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(reach[start][path[-1]])
        path.reverse()
        steps = [path[0]] + [f"{b} (line {graph[a][b]})" for a, b in itertools.pairwise(path)]
        circles.append(f"{len(members)} modules ({', '.join(members)}): {' → '.join(steps)}")
    return circles


@pytest.mark.parametrize("nested", [False, True], ids=["module-level", "inside-functions-too"])
def test_no_module_imports_itself_round_a_circle(nested: bool) -> None:
    """Layers depend one way: no chain of imports leads from a module back to itself — at module
    level, and neither through the imports inside functions (those stay only to keep a heavy
    optional dependency unloaded until it is used)."""
    assert _circles(_graph(nested=nested)) == []


def _offenders(modules: list[str], allowed: Callable[[str], bool]) -> dict[str, list[str]]:
    offenders = {}
    for module in modules:
        bad = [
            f"{target} (line {line})"
            for target, line in _imports(module, nested=True).items()
            if not allowed(target)
        ]
        if bad:
            offenders[module] = bad
    return offenders


def _within(target: str, *packages: str) -> bool:
    return any(target == p or target.startswith(p + ".") for p in packages)


def _is_section(target: str) -> bool:
    """A config section module: ``stalebound.<layer>.config``."""
    return (
        target.startswith("stalebound.") and target.endswith(".config") and target.count(".") == 2
    )


def test_the_config_tree_composes_sections_only() -> None:
    """``stalebound.config`` puts the layers' own sections together; it imports no engine, task,
    training or runtime logic (only the sections, the loader and the error types)."""
    offenders = _offenders(
        [m for m in MODULES if m == "stalebound.config"],
        lambda t: _is_section(t) or _within(t, "stalebound.typedconfig", "stalebound.core.errors"),
    )
    assert offenders == {}


UTILITIES = (
    "stalebound._lazy",
    "stalebound._heap",
    "stalebound._scoped",
    "stalebound.userfiles",
    "stalebound.typedconfig",
    "stalebound.obs",
)
"""Modules every layer may use: they know no config tree, no engine and no training."""


def test_utilities_import_no_config_no_engines_no_training() -> None:
    offenders = _offenders(
        [m for m in MODULES if _within(m, *UTILITIES)],
        lambda t: _within(t, "stalebound.core", *UTILITIES),
    )
    assert offenders == {}


JOB = ("stalebound.train.recipe", "stalebound.train.backends", "stalebound.train.preflight")


def test_the_ray_backend_and_the_job_depend_one_way() -> None:
    """The job picks the Ray backend (train/backends.py imports distributed/); the Ray backend runs
    the trainer's parts (train/trainer.py, losses, config) and never the job that picks it."""
    train = [m for m in MODULES if _within(m, "stalebound.train")]
    importers = sorted(
        m
        for m in train
        if any(_within(t, "stalebound.distributed") for t in _imports(m, nested=True))
    )
    assert importers == ["stalebound.train.backends"]
    offenders = _offenders(
        [m for m in MODULES if _within(m, "stalebound.distributed")],
        lambda t: not _within(t, *JOB),
    )
    assert offenders == {}


# -- docs/architecture.md, drawn from the code ------------------------------------------------------

DOC = SRC.parent / "docs" / "architecture.md"


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gen_architecture", SRC.parent / "scripts" / "gen_architecture.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_doc_is_current() -> None:
    generator = _generator()
    committed = DOC.read_text(encoding="utf-8")
    assert generator.render(committed) == committed, (
        f"docs/architecture.md is out of date; regenerate it with `{generator.COMMAND}`"
    )


def test_the_architecture_doc_draws_every_event_action_and_policy() -> None:
    from stalebound.core import events
    from stalebound.runtime.config import RolloutConfig

    text = DOC.read_text(encoding="utf-8")
    flow = text.split("| event (driver → core) |", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`(\w+)`", flow))
    kinds = [*typing.get_args(events.Event), *typing.get_args(events.Action)]
    assert sorted(k.__name__ for k in kinds if k.__name__ not in named) == []
    policies = typing.get_args(typing.get_type_hints(RolloutConfig)["staleness_policy"])
    assert [p for p in policies if f"\n### `{p}`\n" not in text] == []
