"""The docs say what the code does: each list a command has is there in full."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

from stalebound.sim.simulator import POLICIES

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_the_readme_names_every_policy_the_simulator_runs() -> None:
    section = _section(README, "The simulator")
    named = set(re.findall(r"`([a-z+-]+)`", section))
    assert set(POLICIES) <= named, f"not in README's simulator section: {set(POLICIES) - named}"


def test_every_objective_of_the_readmes_ablation_command_has_a_row() -> None:
    section = _section(README, "Learning under staleness: which objective at which η")
    command = re.search(r"stalebound ablate --objective\s+([a-z+ \n]+?)`", section)
    assert command, "the measured command is not in the section"
    rows = set(re.findall(r"^\| `([a-z+]+)` \|", section, flags=re.M))
    assert set(command.group(1).split()) == rows


def test_the_docs_cite_only_documents_in_the_repository() -> None:
    cited = [
        str(path.relative_to(ROOT))
        for path in [*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("src/**/*.py")]
        if "DESIGN.md" in path.read_text()
    ]
    assert cited == [], "DESIGN.md is not in the repository"


def test_the_license_pyproject_names_is_in_the_repository() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_the_run_directory_table_names_what_a_run_writes() -> None:
    text = (ROOT / "docs" / "observability.md").read_text()
    for name in ("policy-v0/", ".lock", "trace-from-step-K.jsonl", "abandoned/", "ledger.jsonl"):
        assert f"`{name}`" in text, name


def test_ci_runs_areals_own_manager_tests_from_the_shared_directory() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'AREAL_TESTS="$(cd .. && pwd)/shared/peer/areal/test_staleness_manager.py"' in ci
    assert 'AREAL_TESTS="$AREAL_TESTS" make test-areal' in ci
