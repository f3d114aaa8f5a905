"""The configuration mechanism: YAML layers, overrides, aliases, flags, validation, dump, docs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalebound.config import (
    ALIASES,
    SYNONYMS,
    StaleboundConfig,
    config_reference,
    dump_yaml,
    load_config,
    parse_cli_overrides,
)
from stalebound.core.errors import ConfigError
from stalebound.typedconfig import Invalid, Schema, bounds, field_docs

ROOT = Path(__file__).resolve().parents[1]


def problems_of(*args: Any, **kwargs: Any) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return info.value.problems


# -- defaults, files, overrides ---------------------------------------------------------------------


def test_no_sources_give_the_defaults() -> None:
    assert load_config() == StaleboundConfig()


def test_yaml_files_merge_in_order_then_overrides(tmp_path: Path) -> None:
    first = tmp_path / "first.yaml"
    first.write_text("seed: 1\nrollout:\n  group_size: 8\n  consumer_batch_size: 16\n")
    second = tmp_path / "second.yml"
    second.write_text("rollout:\n  group_size: 2\n  proactive_filter: {method: retry}\n")
    config = load_config([first, str(second)], ["rollout.consumer_batch_size=32", "seed=7"])
    assert config.seed == 7
    assert config.rollout.group_size == 2
    assert config.rollout.consumer_batch_size == 32
    assert config.rollout.proactive_filter.method == "retry"
    assert config.rollout.proactive_filter.threshold == 4


def test_a_single_path_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("seed: 3\n")
    assert load_config(path).seed == 3  # type: ignore[arg-type]


def test_empty_yaml_file_is_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    assert load_config([path]) == StaleboundConfig()


def test_override_values_are_yaml() -> None:
    config = load_config(
        overrides=[
            "rollout.max_concurrent_rollouts=64",
            "rollout.max_concurrent_rollouts=null",
            "rollout.request_timeout=5",
            "rollout.group_post_process.enable=true",
            "rollout.proactive_filter={method: truncate, threshold: 2}",
        ]
    )
    assert config.rollout.max_concurrent_rollouts is None
    assert config.rollout.request_timeout == 5.0
    assert isinstance(config.rollout.request_timeout, float)
    assert config.rollout.group_post_process.enable is True
    assert config.rollout.proactive_filter.method == "truncate"
    assert config.rollout.proactive_filter.threshold == 2


def test_the_same_override_repeated_keeps_the_last() -> None:
    config = load_config(overrides=["rollout.group_size=3", "rollout.group_size=5"])
    assert config.rollout.group_size == 5


def test_an_empty_section_in_a_later_file_keeps_earlier_settings(tmp_path: Path) -> None:
    first = tmp_path / "first.yaml"
    first.write_text("rollout: {group_size: 6}\n")
    second = tmp_path / "second.yaml"
    second.write_text("rollout: {}\npsrl: {}\n")
    assert load_config([first, second]).rollout.group_size == 6


def test_a_later_scalar_replaces_a_whole_section(tmp_path: Path) -> None:
    first = tmp_path / "first.yaml"
    first.write_text("rollout: {group_size: 6}\n")
    assert problems_of([first], ["rollout=null"]) == (
        "rollout=null: must be a mapping of its fields; "
        "set them one by one, like rollout.staleness_policy=…",
    )


def test_alias_tables_are_checked() -> None:
    with pytest.raises(TypeError, match=r"targets rollout\.nothing, not a field"):
        Schema(StaleboundConfig, {"x": "rollout.nothing"})
    with pytest.raises(TypeError, match="shadows a field"):
        Schema(StaleboundConfig, {"seed": "rollout.group_size"})


def test_dotted_keys_inside_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout.group_size: 6\n")
    assert load_config([path]).rollout.group_size == 6


# -- exact error messages ---------------------------------------------------------------------------


def test_bound_violation_message() -> None:
    assert problems_of(overrides=["rollout.max_head_offpolicyness=-1"]) == (
        "rollout.max_head_offpolicyness=-1: must be an integer ≥ 0; use 0 for synchronous training",
    )


def test_optional_bound_violation_message() -> None:
    assert problems_of(overrides=["rollout.max_concurrent_rollouts=0"]) == (
        "rollout.max_concurrent_rollouts=0: must be an integer ≥ 1 or null; "
        "allow at least one rollout, or null for all the window allows",
    )


def test_no_silent_coercion_to_int() -> None:
    assert problems_of(overrides=["rollout.group_size=abc"]) == (
        "rollout.group_size=abc: must be an integer; write a whole number (default: 4)",
    )
    assert problems_of(overrides=["rollout.group_size=4.0"]) == (
        "rollout.group_size=4.0: must be an integer; write a whole number (default: 4)",
    )
    assert problems_of(overrides=['rollout.group_size="4"']) == (
        "rollout.group_size='4': must be an integer; write a whole number (default: 4)",
    )
    assert problems_of(overrides=["rollout.group_size=true"]) == (
        "rollout.group_size=true: must be an integer; write a whole number (default: 4)",
    )


def test_other_type_messages() -> None:
    assert problems_of(overrides=["rollout.request_timeout=soon"]) == (
        "rollout.request_timeout=soon: must be a number; write a number (default: 3600.0)",
    )
    assert problems_of(overrides=["rollout.reject_stale_results=1"]) == (
        "rollout.reject_stale_results=1: must be true or false; "
        "write rollout.reject_stale_results=true or rollout.reject_stale_results=false",
    )
    assert problems_of(overrides=["rollout.filter_groups.metric=3"]) == (
        'rollout.filter_groups.metric=3: must be a string; quote it: rollout.filter_groups.metric="3"',
    )
    assert problems_of(overrides=["rollout.staleness_policy=bufer"]) == (
        "rollout.staleness_policy=bufer: must be one of buffer, capacity, deadline; did you mean "
        "buffer?",
    )
    assert problems_of(overrides=["rollout.proactive_filter.method=wait"]) == (
        "rollout.proactive_filter.method=wait: must be one of 'null', retry, truncate; "
        "use one of them",
    )


def test_null_for_a_non_optional_field() -> None:
    assert problems_of(overrides=["rollout.group_size=null"]) == (
        "rollout.group_size=null: must not be null; "
        "write an integer or remove the key to keep the default (4)",
    )


def test_section_given_a_scalar() -> None:
    assert problems_of(overrides=["rollout=3"]) == (
        "rollout=3: must be a mapping of its fields; "
        "set them one by one, like rollout.staleness_policy=…",
    )


def test_unknown_keys_suggest_the_closest() -> None:
    assert problems_of(overrides=["rollout.consumer_bach_size=8"]) == (
        "rollout.consumer_bach_size=8: unknown key; did you mean rollout.consumer_batch_size?",
    )
    # A known name in the wrong section points at the right one.
    assert problems_of(overrides=["group_size=8"]) == (
        "group_size=8: unknown key; did you mean rollout.group_size?",
    )
    assert problems_of(overrides=["psrl.stalenes=2"]) == (
        "psrl.stalenes=2: unknown key; did you mean psrl.staleness?",
    )
    assert problems_of(overrides=["zzzz=1"]) == (
        "zzzz=1: unknown key; remove it (python -m stalebound.config --reference lists every key)",
    )


def test_an_unknown_key_suggests_the_key_that_means_the_same() -> None:
    # what users of other trainers write, answered with the name here (not the closest spelling:
    # train.learning_rate is spelt most like train.mask_truncated)
    assert problems_of(overrides=["train.learning_rate=1e-5"]) == (
        "train.learning_rate=1e-5: unknown key; did you mean train.lr?",
    )
    assert problems_of(overrides=["rollout.batch_size=16", "engine.batch_size=64"]) == (
        "rollout.batch_size=16: unknown key; did you mean rollout.consumer_batch_size?",
        "engine.batch_size=64: unknown key; did you mean engine.max_batch_size?",
    )
    assert problems_of(overrides=["rollout.n=4", "rollout.num_samples=4", "run.max_steps=9"]) == (
        "rollout.n=4: unknown key; did you mean rollout.group_size?",
        "rollout.num_samples=4: unknown key; did you mean rollout.group_size?",
        "run.max_steps=9: unknown key; did you mean run.steps?",
    )
    with pytest.raises(ConfigError) as info:
        parse_cli_overrides(["--learning-rate", "1e-5", "--train.learning-rate=1e-5"])
    assert info.value.problems == (
        "--learning-rate=1e-5: unknown flag; did you mean --train.lr?",
        "--train.learning-rate=1e-5: unknown flag; did you mean --train.lr?",
    )


def test_every_synonym_names_a_real_key() -> None:
    names = {key.rsplit(".", 1)[-1] for key in Schema(StaleboundConfig, ALIASES).spellings()}
    assert set(SYNONYMS) <= names
    assert not set().union(*SYNONYMS.values()) & names  # a synonym is never a real name


def test_unknown_section_is_reported_once_at_its_top(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollot:\n  group_size: 3\n  consumer_batch_size: 4\n")
    assert problems_of([path]) == (
        "rollot={group_size: 3, consumer_batch_size: 4}: unknown key; did you mean rollout?",
    )


def test_cross_field_rules() -> None:
    assert problems_of(overrides=["rollout.buffer_size=4"]) == (
        "rollout.buffer_size=4: must be ≥ consumer_batch_size (8): a buffer holds the batch plus "
        "its redundancy; use at least 8, or null for B′ = B",
    )
    assert problems_of(overrides=["rollout.group_redundancy=2"]) == (
        "rollout.group_redundancy=2: must be ≥ group_size (4): N′ members are launched to "
        "finish N; use at least 4, or null for N′ = N",
    )
    assert problems_of(overrides=["rollout.reject_stale_results=true"]) == (
        "rollout.reject_stale_results=true: only applies to staleness_policy=capacity (the buffer "
        "policy never trains a stale result); set it to false, or use staleness_policy=capacity",
    )


def test_cross_field_rules_name_the_spelling_used() -> None:
    assert problems_of(overrides=["psrl.redundant_rollout.rollout_n=3"]) == (
        "psrl.redundant_rollout.rollout_n=3: must be ≥ group_size (4): N′ members are launched "
        "to finish N; use at least 4, or null for N′ = N",
    )


def test_valid_redundancy_is_accepted() -> None:
    config = load_config(overrides=["rollout.buffer_size=10", "rollout.group_redundancy=6"])
    assert (config.rollout.buffer_size, config.rollout.group_redundancy) == (10, 6)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "seed: x\nrollout:\n  consumer_batch_size: 0\n  group_size: -2\n"
        "  proactive_filter: {threshold: -1}\n  unknown_thing: 1\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(
            [path, tmp_path / "missing.yaml"], ["rollout.max_head_offpolicyness=-1", "oops"]
        )
    assert str(info.value) == "\n".join(
        [
            "8 configuration problems:",
            f"  - config={tmp_path / 'missing.yaml'}: cannot read it (No such file or directory); "
            "check the path",
            "  - oops=(missing): not a key=value override; write it as key.path=value, "
            "like rollout.group_size=8",
            "  - seed=x: must be an integer; write a whole number (default: 0)",
            "  - rollout.max_head_offpolicyness=-1: must be an integer ≥ 0; "
            "use 0 for synchronous training",
            "  - rollout.consumer_batch_size=0: must be an integer ≥ 1; "
            "train on at least one group per step",
            "  - rollout.group_size=-2: must be an integer ≥ 1; "
            "use 1 for no grouping, more for GRPO-style groups",
            "  - rollout.proactive_filter.threshold=-1: must be an integer ≥ 0; "
            "count RESERVED entries, e.g. 4 (the default)",
            "  - rollout.unknown_thing=1: unknown key; did you mean rollout.workflow_args?",
        ]
    )


def test_cross_field_rules_wait_for_valid_fields() -> None:
    # consumer_batch_size is wrong, so buffer_size is not compared with it.
    assert problems_of(overrides=["rollout.consumer_batch_size=x", "rollout.buffer_size=4"]) == (
        "rollout.consumer_batch_size=x: must be an integer; write a whole number (default: 8)",
    )


def test_yaml_syntax_errors_and_non_mappings(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [unclosed\n")
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    problems = problems_of([bad, listed])
    assert len(problems) == 2
    assert problems[0].startswith(f"config={bad}: not valid YAML (")
    assert problems[0].endswith("); fix the syntax")
    assert problems[1] == (
        f"config={listed}: the file holds [a, b], not a mapping; "
        "write one key: value per line at the top level"
    )


def test_duplicate_yaml_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("seed: 1\nseed: 2\n")
    (problem,) = problems_of([path])
    assert "found the key seed twice" in problem


def test_bad_override_syntax() -> None:
    assert problems_of(overrides=["seed="]) == (
        "seed=: empty value; write seed=null for null or seed='' for an empty string",
    )
    (problem,) = problems_of(overrides=["seed=[1, 2"])
    assert problem.startswith("seed=[1, 2: not a valid YAML value (")
    assert problem.endswith("); quote it: seed='[1, 2'")
    assert problems_of(overrides=["rollout..group_size=1"]) == (
        "rollout..group_size=1: not a valid key; write dot-separated names without spaces, "
        "like rollout.group_size",
    )


def test_a_hash_is_text_not_a_comment() -> None:
    config = load_config(overrides=["rollout.filter_groups.metric=#acc"])
    assert config.rollout.filter_groups.metric == "#acc"


# -- aliases ----------------------------------------------------------------------------------------

ALIAS_CASES = [
    ("max_head_offpolicyness", 5, ("staleness",)),
    ("rollout.max_head_offpolicyness", 4, ("staleness",)),
    ("max_concurrent_rollouts", 64, ("max_concurrent_rollouts",)),
    ("consumer_batch_size", 16, ("consumer_batch_size",)),
    ("psrl.staleness", 3, ("staleness",)),
    ("psrl.rollout_n", 8, ("group_size",)),
    ("psrl.proactive_filter_strategy.method", "retry", ("proactive_filter", "method")),
    ("psrl.proactive_filter_strategy.threshold", 2, ("proactive_filter", "threshold")),
    (
        "psrl.rollout_coordination.proactive_filter_strategy.method",
        "truncate",
        ("proactive_filter", "method"),
    ),
    (
        "psrl.rollout_coordination.proactive_filter_strategy.threshold",
        7,
        ("proactive_filter", "threshold"),
    ),
    ("psrl.group_post_process.enable", True, ("group_post_process", "enable")),
    ("psrl.group_post_process.name", "my_filter", ("group_post_process", "name")),
    ("algorithm.filter_groups.metric", "acc", ("filter_groups", "metric")),
    ("psrl.redundant_rollout.buffer_size", 12, ("buffer_size",)),
    ("psrl.redundant_rollout.rollout_n", 6, ("group_redundancy",)),
]


def rollout_value(config: StaleboundConfig, attrs: tuple[str, ...]) -> Any:
    value: Any = config.rollout
    for attr in attrs:
        value = getattr(value, attr)
    return value


def test_alias_cases_cover_the_whole_table() -> None:
    rollout_aliases = [a for a, key in ALIASES.items() if key.startswith("rollout.")]
    assert sorted(alias for alias, _, _ in ALIAS_CASES) == sorted(rollout_aliases)
    # the trainer ranks' count and timeout (tested in tests/test_parallel.py), and resume
    assert sorted(set(ALIASES) - set(rollout_aliases)) == [
        "ray.rank_timeout_s",
        "ray.train_data_parallel_size",
        "resume",
    ]
    for alias, _, attrs in ALIAS_CASES:
        assert ALIASES[alias] == "rollout." + ".".join(attrs)


@pytest.mark.parametrize(("alias", "value", "attrs"), ALIAS_CASES)
def test_alias_in_an_override(alias: str, value: Any, attrs: tuple[str, ...]) -> None:
    config = load_config(overrides=[f"{alias}={yaml.safe_dump(value).splitlines()[0]}"])
    assert rollout_value(config, attrs) == value


@pytest.mark.parametrize(("alias", "value", "attrs"), ALIAS_CASES)
def test_alias_in_yaml(tmp_path: Path, alias: str, value: Any, attrs: tuple[str, ...]) -> None:
    nested: Any = value
    for part in reversed(alias.split(".")):
        nested = {part: nested}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(nested))
    assert rollout_value(load_config([path]), attrs) == value


def test_psrl_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "psrl.yaml"
    path.write_text(
        "psrl:\n"
        "  staleness: 1\n"
        "  rollout_n: 8\n"
        "  proactive_filter_strategy:\n"
        "    method: null\n"
        "    threshold: 4\n"
        "  group_post_process:\n"
        "    enable: true\n"
        "    name: dynamic_sampling_filter\n"
        "algorithm:\n"
        "  filter_groups:\n"
        "    metric: seq_reward\n"
    )
    rollout = load_config([path]).rollout
    assert rollout.staleness == 1
    assert rollout.group_size == 8
    assert rollout.proactive_filter.method == "null"  # PSRL's YAML null is the "null" method
    assert rollout.group_post_process.enable is True
    assert rollout.filter_groups.metric == "seq_reward"


def test_null_method_in_an_override(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout: {proactive_filter: {method: retry}}\n")
    assert load_config([path]).rollout.proactive_filter.method == "retry"
    for key in ("psrl.proactive_filter_strategy.method", "rollout.proactive_filter.method"):
        config = load_config([path], [f"{key}=null"])
        assert config.rollout.proactive_filter.method == "null"


def test_two_spellings_with_different_values_conflict(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("max_head_offpolicyness: 2\npsrl:\n  staleness: 3\n")
    assert problems_of([path]) == (
        "psrl.staleness=3: conflicts with max_head_offpolicyness=2 "
        "(both set rollout.staleness); keep only one of them",
    )
    assert problems_of(overrides=["psrl.rollout_n=4", "rollout.group_size=5"]) == (
        "rollout.group_size=5: conflicts with psrl.rollout_n=4 (both set rollout.group_size); "
        "keep only one of them",
    )


def test_two_spellings_with_the_same_value_agree(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("max_head_offpolicyness: 3\npsrl: {staleness: 3}\n")
    assert load_config([path]).rollout.staleness == 3


def test_a_later_source_overrides_another_spelling(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout: {max_head_offpolicyness: 2}\n")
    config = load_config([path], ["max_head_offpolicyness=9"])
    assert config.rollout.staleness == 9
    assert load_config([path], ["psrl.staleness=0"]).rollout.staleness == 0


def test_alias_errors_name_the_alias() -> None:
    assert problems_of(overrides=["psrl.staleness=-1"]) == (
        "psrl.staleness=-1: must be an integer ≥ 0; use 0 for synchronous training",
    )


# -- command-line flags -----------------------------------------------------------------------------


def test_flags_positional_files_and_overrides() -> None:
    paths, overrides = parse_cli_overrides(
        [
            "base.yaml",
            "--max-head-offpolicyness",
            "1000",
            "--max-concurrent-rollouts=64",
            "--consumer-batch-size",
            "8",
            "rollout.group_size=2",
            "--rollout.proactive-filter.threshold",
            "-1",
            "--config",
            "extra.yml",
        ]
    )
    assert paths == ["base.yaml", "extra.yml"]
    assert overrides == [
        "max_head_offpolicyness=1000",
        "max_concurrent_rollouts=64",
        "consumer_batch_size=8",
        "rollout.group_size=2",
        "rollout.proactive_filter.threshold=-1",
    ]


def test_flags_load() -> None:
    _, overrides = parse_cli_overrides(
        ["--max-head-offpolicyness", "1000", "--max-concurrent-rollouts", "64"]
    )
    rollout = load_config(overrides=overrides).rollout
    assert (rollout.staleness, rollout.max_concurrent_rollouts) == (1000, 64)


def test_flag_problems_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        parse_cli_overrides(["--max-head-offpolicy", "3", "notes.txt", "--seed"])
    assert info.value.problems == (
        "--max-head-offpolicy=3: unknown flag; did you mean --max-head-offpolicyness?",
        "notes.txt=(missing): neither a YAML file nor key=value; give a .yaml/.yml path, "
        "key.path=value, or --flag VALUE",
        "--seed=(missing): needs a value; write --seed VALUE or --seed=VALUE",
    )


def test_unknown_flag_without_a_close_match() -> None:
    with pytest.raises(ConfigError) as info:
        parse_cli_overrides(["--qqqqqqq=1"])
    assert info.value.problems == (
        "--qqqqqqq=1: unknown flag; use a known flag or key.path=value "
        "(python -m stalebound.config --reference lists every key)",
    )


# -- dump and round trip ----------------------------------------------------------------------------


def test_dump_round_trip(tmp_path: Path) -> None:
    config = load_config(
        overrides=[
            "seed=11",
            "rollout.staleness_policy=capacity",
            "rollout.reject_stale_results=true",
            "rollout.max_concurrent_rollouts=48",
            "rollout.buffer_size=10",
            "rollout.proactive_filter.method=null",
            "rollout.proactive_filter.stuck_timeout_s=2.5",
            "rollout.filter_groups.metric='123'",
        ]
    )
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_yaml(config))
    assert load_config([path]) == config
    assert load_config([path]) != StaleboundConfig()
    assert yaml.safe_load(dump_yaml(StaleboundConfig()))["rollout"]["staleness"] == 2


def test_main_prints_the_resolved_config_and_errors() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "stalebound.config", "--consumer-batch-size", "16"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout)["rollout"]["consumer_batch_size"] == 16
    bad = subprocess.run(
        [sys.executable, "-m", "stalebound.config", "seed=x"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr == "seed=x: must be an integer; write a whole number (default: 0)\n"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_main_prints_its_help(flag: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "stalebound.config", flag],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith(
        "usage: python -m stalebound.config [CONFIG.yaml ...] [key.path=value ...] "
        "[--flag VALUE ...]\n"
    )
    assert "  --reference   print the reference of every key" in done.stdout


def _printed_and_trained(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[Any, Any]:
    """What ``python -m stalebound.config ARGV`` prints (the same as ``stalebound train
    --print-config ARGV``), and the settings ``stalebound train ARGV`` hands to the job (caught
    where the job would start), both as plain data."""
    from stalebound.cli import main as cli_main
    from stalebound.config.cli import main as config_main
    from stalebound.train import recipe
    from stalebound.typedconfig import to_plain

    assert config_main(argv) == 0
    text = capsys.readouterr().out
    assert cli_main(["train", "--print-config", *argv]) == 0
    assert capsys.readouterr().out == text
    printed = yaml.safe_load(text)
    trained: list[StaleboundConfig] = []
    monkeypatch.setattr(recipe, "run_training", lambda cfg: trained.append(cfg))
    assert cli_main(["train", *argv]) == 0
    return printed, to_plain(trained[0])


def test_main_prints_what_train_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    printed, trained = _printed_and_trained(["run.steps=3"], monkeypatch, capsys)
    assert printed == trained
    # the train recipe's policy and bound, not the tree's defaults
    assert (printed["rollout"]["staleness_policy"], printed["rollout"]["staleness"]) == (
        "deadline",
        4,
    )
    assert StaleboundConfig().rollout.staleness_policy == "buffer"


def test_main_prints_what_a_resumed_run_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = load_config(overrides=["rollout.staleness=1", "run.steps=5"])
    (run_dir / "config.yaml").write_text(dump_yaml(saved))
    argv = [f"resume={run_dir}", "run.steps=8"]
    printed, trained = _printed_and_trained(argv, monkeypatch, capsys)
    assert printed == trained
    assert printed["rollout"]["staleness"] == 1  # the run's own settings
    assert printed["run"]["steps"] == 8  # what the command line says on top
    assert printed["run"]["run_dir"] == str(run_dir)


def test_printed_settings_write_out_the_deadline_policys_target_and_margin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for eta, target, margin in ((4, 2, 1), (8, 4, 1), (16, 8, 2)):
        printed, trained = _printed_and_trained([f"rollout.staleness={eta}"], monkeypatch, capsys)
        assert printed == trained
        deadline = printed["rollout"]["deadline"]
        assert (deadline["target"], deadline["margin"]) == (target, margin)
    given = ["rollout.deadline.target=1", "rollout.deadline.margin=3"]
    printed, _ = _printed_and_trained(given, monkeypatch, capsys)
    assert (printed["rollout"]["deadline"]["target"], printed["rollout"]["deadline"]["margin"]) == (
        1,
        3,
    )


def test_a_users_model_gets_pretrained_defaults_and_the_demo_keeps_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalebound.engines.models import build_default_model

    def train(argv: list[str]) -> dict[str, Any]:
        printed, trained = _printed_and_trained(argv, monkeypatch, capsys)
        assert printed == trained
        return {k: printed["train"][k] for k in ("lr", "warm_start_steps", "micro_batch_tokens")}

    users = tmp_path / "my-checkpoint"
    assert train([f"engine.model_path={users}"]) == {
        "lr": 1e-6,
        "warm_start_steps": 0,
        "micro_batch_tokens": 16384,
    }
    # what the user sets wins, from the command line or a file
    own = tmp_path / "own.yaml"
    own.write_text(f"engine:\n  model_path: {users}\ntrain:\n  warm_start_steps: 20\n")
    assert train([str(own), "train.lr=3e-5"]) == {
        "lr": 3e-5,
        "warm_start_steps": 20,
        "micro_batch_tokens": 16384,
    }
    demo = {"lr": 1e-3, "warm_start_steps": 40, "micro_batch_tokens": None}
    assert train([]) == demo
    assert train([f"engine.model_path={build_default_model(tmp_path / 'default')}"]) == demo


def test_print_config_writes_nothing_and_reports_bad_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalebound.cli import main as cli_main

    run_dir = tmp_path / "run"
    assert cli_main(["train", "--print-config", f"run.run_dir={run_dir}"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["run"]["run_dir"] == str(run_dir)
    assert list(tmp_path.iterdir()) == []
    assert cli_main(["train", "--print-config", "train.lr=0"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (
        "stalebound train: train.lr=0.0: must be a finite number > 0 (1e-3 suits the tiny model); "
        "see docs/config.md\n"
    )


# -- the reference documentation --------------------------------------------------------------------


def test_reference_doc_is_current() -> None:
    committed = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert committed == config_reference(), (
        "docs/config.md is out of date; regenerate it with "
        "`python -m stalebound.config --reference > docs/config.md`"
    )


def test_reference_lists_every_key_and_alias() -> None:
    text = config_reference()
    schema = Schema(StaleboundConfig, ALIASES)
    for spelling in schema.spellings():
        assert f"| `{spelling}` |" in text
    assert "| `rollout.staleness` | int | `2` | η, the staleness bound" in text
    assert "| `psrl.staleness` | `rollout.staleness` | `--psrl.staleness` |" in text
    assert (
        "| `rollout.max_head_offpolicyness` | `rollout.staleness`; with "
        "`rollout.staleness_policy=deadline`, `rollout.deadline.target` "
        "| `--rollout.max-head-offpolicyness` |" in text
    )


def test_every_field_is_documented() -> None:
    """A field's docstring, or for a section its class docstring, is its reference entry."""
    schema = Schema(StaleboundConfig)
    for path, (owner, f, tp) in schema.fields.items():
        doc = field_docs(owner).get(f.name)
        if not doc and path in schema.sections:
            section = tp if isinstance(tp, type) else get_args(tp)[0]
            generated = f"{section.__name__}("  # what @dataclass writes when there is no docstring
            doc = None if (section.__doc__ or generated).startswith(generated) else section.__doc__
        assert doc, f"{'.'.join(path)} has no docstring"


def test_reference_from_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "stalebound.config", "--reference"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        check=True,
    )
    assert done.stdout == config_reference()


# -- the loader is generic over any dataclass tree --------------------------------------------------


@dataclass
class Endpoint:
    """One server."""

    url: str
    """Required: where it listens."""
    weight: float = 1.0
    """Share of the traffic."""


@dataclass
class Engine:
    """A toy section with container types."""

    urls: list[str] = field(default_factory=list)
    """Server addresses."""
    ports: tuple[int, ...] = (8000,)
    """Ports to try."""
    env: dict[str, int] = field(default_factory=dict)
    """Extra settings."""
    endpoints: list[Endpoint] = field(default_factory=list)
    """Servers with weights."""
    mode: int | str = 0
    """A number or a name."""
    kind: Literal["a", "b"] | None = None
    """Optional choice."""


@dataclass
class Extra:
    """An optional section."""

    level: int = field(default=1, metadata=bounds(ge=1, le=3, fix="use 1, 2 or 3"))
    """How much."""


@dataclass
class ToyRoot:
    """A tree that is not stalebound's."""

    name: str
    """Required."""
    engine: Engine = field(default_factory=Engine)
    """The engine."""
    extra: Extra | None = None
    """Off by default."""

    config_aliases: ClassVar[dict[str, str]] = {"servers": "engine.urls"}

    def _validate(self) -> Iterator[Invalid]:
        if self.extra is not None and self.name == "plain":
            yield Invalid("extra.level", "needs a fancy name", "rename it or drop extra")


def test_generic_tree_containers() -> None:
    toy = load_config(
        overrides=[
            "name=x",
            "servers=[http://a,http://b]",
            "engine.ports=[1, 2]",
            "engine.env={a: 1}",
            "engine.endpoints=[{url: http://c, weight: 2}]",
            "engine.mode=fast",
            "engine.kind=b",
            "extra.level=3",
        ],
        base=ToyRoot,
    )
    assert toy.engine.urls == ["http://a", "http://b"]
    assert toy.engine.ports == (1, 2)
    assert toy.engine.env == {"a": 1}
    assert toy.engine.endpoints == [Endpoint("http://c", 2.0)]
    assert toy.engine.mode == "fast"
    assert toy.extra == Extra(3)
    text = dump_yaml(toy)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "toy.yaml"
        path.write_text(text)
        assert load_config([path], base=ToyRoot) == toy


def test_generic_tree_problems() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            overrides=[
                "engine.urls=http://a",
                "engine.ports=[1, x]",
                "engine.env={a: b}",
                "engine.endpoints=[{weight: 2, wieght: 3}]",
                "engine.mode=[1]",
                "extra.level=4",
            ],
            base=ToyRoot,
        )
    assert info.value.problems == (
        "name=(missing): required; give a string",
        "engine.urls=http://a: must be a list; write a list: engine.urls=[http://a]",
        "engine.ports[1]=x: must be an integer; write a whole number",
        "engine.env.a=b: must be an integer; write a whole number",
        "engine.endpoints[0].url=(missing): required; give a string",
        "engine.endpoints[0].wieght=3: unknown key; did you mean engine.endpoints[0].weight?",
        "engine.mode=[1]: must be an integer or a string; write an integer or a string (default: 0)",
        "extra.level=4: must be an integer ≥ 1 and ≤ 3; use 1, 2 or 3",
    )


def test_generic_tree_optional_section_and_hook() -> None:
    assert load_config(overrides=["name=x", "extra=null"], base=ToyRoot).extra is None
    assert load_config(overrides=["name=x"], base=ToyRoot).extra is None
    assert load_config(overrides=["name=x", "extra={}"], base=ToyRoot).extra == Extra()
    assert load_config(data=[{"name": "x", "extra": {}}], base=ToyRoot).extra == Extra()
    assert problems_of(overrides=["name=plain", "extra.level=2"], base=ToyRoot) == (
        "extra.level=2: needs a fancy name; rename it or drop extra",
    )


# -- fuzz: nothing but ConfigError ------------------------------------------------------------------

KEYS = [*Schema(StaleboundConfig, ALIASES).spellings(), "rollout", "psrl", "zz", "a.b", ""]
yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
override_tokens = st.lists(
    st.one_of(
        st.text(max_size=20),
        st.tuples(st.sampled_from(KEYS), st.text(max_size=10)).map("=".join),
        st.tuples(st.sampled_from(KEYS), st.sampled_from(["-1", "0", "7", "null", "[1]"])).map(
            "=".join
        ),
    ),
    max_size=4,
)


def assert_round_trips(config: StaleboundConfig) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dumped.yaml"
        path.write_text(dump_yaml(config), encoding="utf-8")
        assert load_config([path]) == config


@settings(max_examples=150, deadline=None)
@given(override_tokens)
def test_fuzz_overrides_raise_only_config_error(tokens: list[str]) -> None:
    with contextlib.suppress(ConfigError):
        assert_round_trips(load_config(overrides=tokens))
    with contextlib.suppress(ConfigError):
        parse_cli_overrides(tokens)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), yaml_values, max_size=4))
def test_fuzz_yaml_values_raise_only_config_error(mapping: dict[str, Any]) -> None:
    with contextlib.suppress(ConfigError):
        assert_round_trips(load_config(data=[mapping]))


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=60))
def test_fuzz_yaml_text_raises_only_config_error(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        with contextlib.suppress(ConfigError):
            load_config([path])


def test_resume_is_an_override_and_a_flag() -> None:
    paths, overrides = parse_cli_overrides(["--resume", "runs/a", "run.steps=5"])
    assert paths == [] and load_config(overrides=overrides).run.resume == "runs/a"
    assert load_config(overrides=["resume=runs/b"]).run.resume == "runs/b"


def test_exponent_notation_without_a_dot_is_a_number() -> None:
    # YAML 1.1 reads 3e-4 as a string; a float field takes it as the number it means
    assert load_config(overrides=["train.lr=3e-4"]).train.lr == pytest.approx(3e-4)
    assert load_config(data=[{"train": {"lr": "1E-3"}}]).train.lr == pytest.approx(1e-3)
    with pytest.raises(ConfigError, match=r"train\.lr=3e: must be a number"):
        load_config(overrides=["train.lr=3e"])


# -- hostile files: bounded time and memory, one clear error each ----------------------------------


def test_a_config_file_over_one_mib_is_refused_by_its_size_before_it_is_parsed(
    tmp_path: Path,
) -> None:
    big = tmp_path / "big.yaml"
    with big.open("w") as f:  # sparse: 50 MiB of nothing costs no disk
        f.truncate(50 << 20)
    (problem,) = problems_of([big])
    assert problem == (
        f"config={big}: 50 MiB, more than the 1 MiB such a file may hold; keep only settings in "
        "it (a config is a few kilobytes), and give large data as a file of its own "
        "(task.data_path)"
    )


def test_an_alias_bomb_is_refused_while_it_is_composed(tmp_path: Path) -> None:
    # Ten levels, each naming the one below nine times: 9**10 values once expanded.
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    (problem,) = problems_of([bomb])
    assert problem.startswith(
        f"config={bomb}: holds more than 10,000 values (aliases counted as what they name); "
    )
    # the same through an override value
    (problem,) = problems_of(overrides=["engine.urls=" + "{" + ", ".join(lines) + "}"])
    assert "holds more than 10,000 values" in problem and problem.endswith("give a shorter value")


def test_a_few_aliases_still_work_and_a_recursive_one_is_refused(tmp_path: Path) -> None:
    ok = tmp_path / "ok.yaml"
    ok.write_text("x: &n 8\nrollout: {group_size: *n, consumer_batch_size: *n}\n")
    with pytest.raises(ConfigError, match="x=8: unknown key"):
        load_config([ok])
    loop = tmp_path / "loop.yaml"
    loop.write_text("engine:\n  urls: &u [a, *u]\n")
    (problem,) = problems_of([loop])
    assert "the alias *u refers to a value that contains it" in problem


def test_a_file_of_66000_keys_is_refused_by_its_count_of_values(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"  # under 1 MiB, so it gets as far as the parser
    keys.write_text("".join(f"u{i:05d}: {i}\n" for i in range(66_000)))
    assert keys.stat().st_size < 1 << 20
    (problem,) = problems_of([keys])
    assert problem.startswith(f"config={keys}: holds more than 10,000 values")


def test_thousands_of_unknown_keys_list_the_first_twenty_and_count_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from stalebound.typedconfig import schema

    asked: list[str] = []  # the did-you-mean search is the costly part of an unknown key
    real = schema.suggest

    def counted(key: str, *rest: Any) -> str | None:
        asked.append(key)
        return real(key, *rest)

    monkeypatch.setattr(schema, "suggest", counted)
    with pytest.raises(ConfigError) as info:
        load_config(data=[{f"u{i:05d}": i for i in range(66_000)}])
    error = info.value
    assert len(error.problems) == 20 and error.omitted == 65_980
    assert len(asked) == 20
    lines = str(error).splitlines()
    assert lines[0] == "66000 configuration problems:"
    assert lines[1].startswith("  - u00000=0: unknown key; ")
    assert lines[-1] == "  ... and 65980 more (fix these first)"
    assert len(lines) == 22


def test_a_config_file_that_is_not_utf8_names_its_first_bad_byte(tmp_path: Path) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"seed: 1\n\xff\xfe\x00")
    (problem,) = problems_of([binary])
    assert (
        problem
        == f"config={binary}: not UTF-8 text (byte 8 is 0xff; a binary file?); check the path"
    )


def test_areal_keyword_and_attribute_of_the_bound_are_one_setting() -> None:
    import dataclasses

    from stalebound.runtime.config import RolloutConfig

    config = RolloutConfig(max_head_offpolicyness=5, group_size=2)
    assert (config.staleness, config.max_head_offpolicyness) == (5, 5)
    assert [f.name for f in dataclasses.fields(config)].count("staleness") == 1
    assert "max_head_offpolicyness" not in [f.name for f in dataclasses.fields(config)]
    assert dataclasses.replace(config, staleness=0).staleness == 0  # not re-set through AReaL's
    # AReaL's keyword wins, as dataclasses.replace passes the old staleness beside it
    assert dataclasses.replace(config, max_head_offpolicyness=1).staleness == 1


def test_the_config_module_still_exports_the_rollout_section() -> None:
    from stalebound import config
    from stalebound.runtime import config as runtime_config

    assert config.RolloutConfig is runtime_config.RolloutConfig
    assert config.ProactiveFilterConfig is runtime_config.ProactiveFilterConfig
    for alias in runtime_config.STALENESS_ALIASES:
        assert config.ALIASES[alias] == "rollout.staleness"
