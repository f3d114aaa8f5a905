"""Workload YAML: presets load, and bad files fail with every problem named."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalebound.core import ConfigError
from stalebound.sim.config import list_presets, load_preset, load_workload, workload_from_dict
from stalebound.sim.simulator import compute_bound
from stalebound.sim.workload import distribution_mean


def test_reference_preset_matches_the_documented_cluster() -> None:
    cfg = load_preset("reference")
    assert (cfg.lengths.distribution, cfg.lengths.median, cfg.lengths.p99) == (
        "lognormal",
        2000,
        20000,
    )
    assert cfg.lengths.cap == 32768
    assert (cfg.engine.replicas, cfg.engine.max_concurrency) == (16, 128)
    assert (cfg.engine.step_base, cfg.engine.step_per_seq) == (0.020, 0.0001)
    assert (cfg.batch.groups, cfg.batch.group_size, cfg.trainer.step_time) == (32, 8, 15.0)
    assert {"reference", "agentic", "small"} <= set(list_presets())


def test_reference_bound_is_the_training_limit() -> None:
    b = compute_bound(load_preset("reference"))
    assert b.training == pytest.approx(256 / 15)
    # 2048 slots at 32.8 ms a step, over the capped lognormal mean (about 3,240 tokens) less the
    # first, which comes with the prefill
    assert b.mean_length == pytest.approx(3240, rel=0.01)
    assert b.generation == pytest.approx(2048 / ((b.mean_length - 1) * 0.0328))
    assert b.value == b.training


@pytest.mark.parametrize("tokens", [1, 2, 3, 50])
def test_the_bound_holds_for_answers_of_a_few_tokens(tokens: int) -> None:
    # an answer of n tokens decodes n − 1 steps (the first comes with its prefill): a bound that
    # charged n steps was beaten twofold by 2-token answers
    from stalebound.sim.simulator import simulate

    cfg = workload_from_dict(
        {
            "lengths": {"distribution": "fixed", "value": tokens},
            "engine": {"replicas": 1, "max_concurrency": 64, "step_base": 0.01, "step_per_seq": 0},
            "batch": {"groups": 4, "group_size": 8},
            "trainer": {"step_time": 0.001, "per_token": 0.0},
            "run": {"steps": 30},
        }
    )
    assert simulate(cfg, "capacity", 4, seed=0).efficiency <= 1.05  # the window edges add a little


def test_unknown_keys_and_bad_values_are_all_reported(tmp_path: Path) -> None:
    f = tmp_path / "w.yaml"
    f.write_text(
        "engine:\n  replicas: 0\n  step_bse: 0.1\nlengths:\n  median: 100\n  p99: 50\n"
        "batch:\n  groups: two\n"
    )
    with pytest.raises(ConfigError) as info:
        load_workload(f)
    assert info.value.problems == (
        "lengths.p99=50.0: must be > median=100.0; raise p99",
        "engine.replicas=0: must be an integer ≥ 1; set the replica count",
        "batch.groups=two: must be an integer; write a whole number (default: 32)",
        "engine.step_bse=0.1: unknown key; did you mean engine.step_base?",
    )


def test_null_is_accepted_only_where_documented() -> None:
    cfg = workload_from_dict({"lengths": {"cap": None}, "failures": {"max_relaunches": None}})
    assert cfg.lengths.cap is None and cfg.failures.max_relaunches is None
    with pytest.raises(ConfigError, match=r"trainer\.step_time=null: must not be null"):
        workload_from_dict({"trainer": {"step_time": None}})


def test_bad_distribution_and_missing_files_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"lengths\.distribution=gamma: must be one of"):
        workload_from_dict({"lengths": {"distribution": "gamma"}})
    with pytest.raises(ConfigError, match=r"lengths\.file='nope.txt': no such file"):
        workload_from_dict({"lengths": {"distribution": "empirical", "file": "nope.txt"}})
    with pytest.raises(ConfigError, match="preset='huge': no such preset"):
        load_preset("huge")
    with pytest.raises(ConfigError, match="cannot read it"):
        load_workload(tmp_path / "missing.yaml")


def test_empirical_lengths_load_relative_to_the_workload_file(tmp_path: Path) -> None:
    (tmp_path / "lengths.txt").write_text("# tokens\n100\n300\n")
    f = tmp_path / "w.yaml"
    f.write_text("lengths:\n  distribution: empirical\n  file: lengths.txt\n")
    cfg = load_workload(f)
    assert distribution_mean(cfg.lengths, cfg.base_dir) == 200


def test_lognormal_lengths_have_the_configured_median_and_p99() -> None:
    import random

    from stalebound.sim.workload import make_sampler

    cfg = workload_from_dict({"lengths": {"median": 2000, "p99": 20000}})
    draw = make_sampler(cfg.lengths)
    rng = random.Random(0)
    xs = sorted(draw(rng) for _ in range(40_000))
    assert xs[20_000] == pytest.approx(2000, rel=0.03)
    assert xs[39_600] == pytest.approx(20000, rel=0.08)


def test_pareto_mean_matches_its_samples() -> None:
    import random

    from stalebound.sim.workload import make_sampler

    d = workload_from_dict(
        {"lengths": {"distribution": "pareto", "minimum": 100, "alpha": 1.5, "cap": 5000}}
    ).lengths
    rng = random.Random(1)
    draw = make_sampler(d)
    sample = sum(draw(rng) for _ in range(40_000)) / 40_000
    assert sample == pytest.approx(distribution_mean(d), rel=0.03)


def test_reward_latency_is_an_optional_section_and_base_dir_is_not_a_key() -> None:
    cfg = workload_from_dict({"agent": {"reward_latency": {"distribution": "fixed", "value": 0.5}}})
    assert cfg.agent.reward_latency is not None and cfg.agent.reward_latency.value == 0.5
    assert workload_from_dict({"agent": {"reward_latency": None}}).agent.reward_latency is None
    with pytest.raises(ConfigError, match=r"base_dir='/x': unknown key"):
        workload_from_dict({"base_dir": "/x"})
    with pytest.raises(ConfigError, match=r"failures\.rate=1\.0: must be < 1"):
        workload_from_dict({"failures": {"rate": 1.0}})


def test_an_empirical_file_of_groups_gives_each_prompt_one_line(tmp_path: Path) -> None:
    from stalebound.sim.workload import SampledSource

    (tmp_path / "groups.txt").write_text("# one prompt's answers a line\n2 3 50\n7 7 7\n")
    cfg = workload_from_dict(
        {"lengths": {"distribution": "empirical", "file": "groups.txt"}}, base_dir=str(tmp_path)
    )
    assert distribution_mean(cfg.lengths, cfg.base_dir, groups=True) == 76 / 6
    source = SampledSource(cfg, seed=1, group_launch=3)
    lines = [tuple(source.spec(p, 0, m).tokens for m in range(3)) for p in range(40)]
    assert set(lines) == {(2, 3, 50), (7, 7, 7)}  # both drawn, each whole and in member order
    # a relaunch (attempt 1) goes on through the prompt's own line
    assert [source.spec(p, 1, 0).tokens for p in range(40)] == [line[0] for line in lines]

    # the same values one a line: each member draws its own
    (tmp_path / "values.txt").write_text("2\n3\n50\n7\n7\n7\n")
    cfg = workload_from_dict(
        {"lengths": {"distribution": "empirical", "file": "values.txt"}}, base_dir=str(tmp_path)
    )
    source = SampledSource(cfg, seed=1, group_launch=3)
    mixed = [tuple(source.spec(p, 0, m).tokens for m in range(3)) for p in range(40)]
    assert not set(mixed) <= {(2, 3, 50), (7, 7, 7)}


def test_a_bad_value_in_a_group_line_is_named(tmp_path: Path) -> None:
    (tmp_path / "groups.txt").write_text("2 3\n4 x 5\n")
    cfg = workload_from_dict(
        {"lengths": {"distribution": "empirical", "file": "groups.txt"}}, base_dir=str(tmp_path)
    )
    with pytest.raises(ConfigError) as e:
        distribution_mean(cfg.lengths, cfg.base_dir, groups=True)
    assert "file='groups.txt' line 2='x': not a number; one value per line, or one group's " in (
        str(e.value)
    )
    # only the lengths take a group a line: a wait's file of them is refused, naming the line
    with pytest.raises(ConfigError) as e:
        distribution_mean(cfg.lengths, cfg.base_dir)
    assert str(e.value) == (
        "file='groups.txt' line 1='2 3': several values on one line; one value per line (only "
        "lengths take one group's values a line)"
    )


def test_a_group_of_lengths_waits_for_its_longest_member_only_when_it_has_one(
    tmp_path: Path,
) -> None:
    """Half the prompts' answers are all short, half all long. Drawn apart, almost every group
    of 8 holds a long answer and its step waits for it; drawn as lines, half the steps do not."""
    from stalebound.sim.simulator import simulate

    (tmp_path / "groups.txt").write_text("2 2 2 2 2 2 2 2\n400 400 400 400 400 400 400 400\n")
    (tmp_path / "values.txt").write_text("2\n400\n")
    runs = {}
    for name in ("groups", "values"):
        cfg = workload_from_dict(
            {
                "lengths": {"distribution": "empirical", "file": f"{name}.txt"},
                "batch": {"groups": 1, "group_size": 8},
                "trainer": {"step_time": 0.001, "per_token": 0.0},
                "run": {"steps": 40},
            },
            base_dir=str(tmp_path),
        )
        runs[name] = simulate(cfg, "sync", 0, seed=0)
    assert runs["groups"].throughput > 1.3 * runs["values"].throughput, runs
