"""Rules of the house that keep the layers apart."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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
    assert len((root / "runtime" / "executor.py").read_text().splitlines()) <= 700


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
