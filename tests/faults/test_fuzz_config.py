"""Hostile input to the config loader: every refusal is one ConfigError that names the bad key.

Hypothesis feeds ``load_config`` (mappings, YAML files, ``key=value`` overrides) and
``parse_cli_overrides`` (AReaL-style flags) wrong types, NaN and infinities, integers too large
for any setting, unicode and very long strings, misspelt and unknown keys, malformed YAML and bad
override syntax. The loader must either return a config that is valid (every value of its declared
type and inside its bounds, and reloadable from its own dump) or raise
:class:`~stalebound.core.errors.ConfigError`, whose every problem reads ``name=value: why; fix``
and names a key or value that was given. Loading never changes its inputs or the defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stalebound.config import ALIASES, StaleboundConfig, dump_yaml, load_config, parse_cli_overrides
from stalebound.core.errors import ConfigError
from stalebound.typedconfig import Bounds, Schema

SCHEMA = Schema(StaleboundConfig, ALIASES)
KEYS = SCHEMA.spellings()
LEAF_KEYS = [".".join(p) for p in SCHEMA.fields if p not in SCHEMA.sections]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROBLEM = re.compile(r"^\S.*?=.*?: .+; .+$", re.DOTALL)

# -- strategies ------------------------------------------------------------------------------------


def _misspell(key: str, data: st.DataObject) -> str:
    """One edit of ``key``: a dropped, doubled or swapped letter, or a changed case."""
    i = data.draw(st.integers(0, len(key) - 1))
    edit = data.draw(st.sampled_from(["drop", "double", "swap", "upper"]))
    if edit == "drop":
        return key[:i] + key[i + 1 :]
    if edit == "double":
        return key[:i] + key[i] + key[i:]
    if edit == "swap" and i + 1 < len(key):
        return key[:i] + key[i + 1] + key[i] + key[i + 2 :]
    return key.upper()


@st.composite
def keys(draw: st.DrawFn) -> str:
    """A known spelling, a misspelt one, or a malformed dotted key."""
    kind = draw(st.sampled_from(["known", "known", "misspelt", "malformed", "random"]))
    key = draw(st.sampled_from(KEYS))
    if kind == "misspelt":
        return _misspell(key, draw(st.data()))
    if kind == "malformed":
        return draw(
            st.sampled_from([key + ".", "." + key, key.replace(".", ".."), f" {key}", "", "."])
        )
    if kind == "random":
        return draw(st.text(max_size=12))
    return key


HUGE = [2**63, -(2**63) - 1, 10**400, -(10**400)]
# Past Python's 4300-digit limit for int ↔ str (built lazily: even repr() of it fails).
BEYOND_DIGIT_LIMIT = st.sampled_from([1, -1]).map(lambda sign: sign * 10**5000)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(HUGE),
    BEYOND_DIGIT_LIMIT,
    st.floats(),  # NaN and ±inf included
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-308]),
    st.text(max_size=10),
    st.text(min_size=200, max_size=400),
    st.sampled_from(["", " ", "null", "true", "4", "4.0", "x" * 2000, "é", "\u202e", "\x00"]),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6) | keys(), inner, max_size=3)
    ),
    max_leaves=6,
)
# Override texts as a user would type them after "key=": YAML spellings and garbage.
value_texts = st.one_of(
    st.sampled_from(
        [
            "-1",
            "0",
            "1",
            "7",
            "true",
            "null",
            "~",
            "''",
            ".nan",
            ".inf",
            "-.inf",
            "1.0e400",
            "9" * 400,
            "9" * 5000,
            "[",
            "]",
            "{",
            "[1, 2]",
            "[0.9]",
            "[0.9, 0.99, 1]",
            "{a: 1}",
            "{a: 1, a: 2}",
            "!!python/object:os.system",
            "&a [*a]",
            "*nowhere",
            "a: b: c",
            "'unclosed",
            "#",
            "é",
            "\x00",
            "\t",
        ]
    ),
    st.text(max_size=12),
    st.integers().map(str),
    st.floats().map(repr),
)
override_tokens = st.one_of(
    st.tuples(keys(), value_texts).map("=".join),
    st.text(max_size=20),  # no '=', an empty key, anything
    st.sampled_from(["=", "=5", "rollout.=1", ".seed=1", "seed", "a..b=1", " =1", "seed==1"]),
)
yaml_texts = st.one_of(
    st.text(max_size=60),
    st.sampled_from(
        [
            "- 1\n- 2\n",
            "42\n",
            "just text\n",
            "seed: 1\nseed: 2\n",
            "rollout:\n  group_size: 2\n  group_size: 3\n",
            "rollout: [1, 2]\n",
            "rollout:\n  group_size: 4\n   bad: indent\n",
            "? [a, b]\n: 1\n",
            "1: 2\n",
            "seed: !!python/name:os.system\n",
            "a: &x [*x]\n",
            "seed: " + "9" * 5000 + "\n",
            "\ufeffseed: 1\n",
            "seed: 1\n---\nseed: 2\n",
            "%YAML 9.9\n---\nseed: 1\n",
        ]
    ),
    st.dictionaries(keys(), values, max_size=4).map(
        lambda d: yaml.safe_dump(d, allow_unicode=True) if _dumpable(d) else "{}"
    ),
)


def _dumpable(value: Any) -> bool:
    try:
        yaml.safe_dump(value)
    except (yaml.YAMLError, ValueError, RecursionError):
        return False
    return True


# -- the oracle ------------------------------------------------------------------------------------


def _conforms(value: Any, tp: Any) -> bool:
    """Whether ``value`` is of the declared field type ``tp`` (as the loader converts it)."""
    origin = get_origin(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin in (Union, types.UnionType):
        return any(_conforms(value, arm) for arm in get_args(tp))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
    if tp is float:
        return isinstance(value, float) and not math.isnan(value)
    if tp is str:
        return isinstance(value, str)
    if origin is Literal:
        return any(type(value) is type(c) and value == c for c in get_args(tp))
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, get_args(tp)[0]) for v in value)
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, tuple):
            return False
        if args[-1:] == (Ellipsis,):
            return all(_conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(map(_conforms, value, args))
    if origin is dict:
        return isinstance(value, dict) and all(
            isinstance(k, str) and _conforms(v, get_args(tp)[1]) for k, v in value.items()
        )
    if dataclasses.is_dataclass(tp):
        return isinstance(value, tp)
    raise AssertionError(f"the oracle does not know the field type {tp!r}")


def assert_valid(config: StaleboundConfig) -> None:
    """Every field of its declared type and inside its bounds; the dump reloads to an equal tree."""
    for path, (_, f, tp) in SCHEMA.fields.items():
        value: Any = config
        for part in path:
            value = getattr(value, part)
        assert _conforms(value, tp), f"{'.'.join(path)}={value!r} is not a {tp}"
        rule: Bounds | None = f.metadata.get("stalebound.bounds")
        if rule is not None and value is not None:
            assert not rule.violated(value), f"{'.'.join(path)}={value!r} breaks {rule}"
    assert not config.train.problems()
    with tempfile.TemporaryDirectory() as tmp:
        dumped = Path(tmp) / "dumped.yaml"
        dumped.write_text(dump_yaml(config), encoding="utf-8")
        assert load_config([dumped]) == config


def _names(given_keys: list[str]) -> set[str]:
    """Every name a problem about these keys may start with or mention."""
    names = {"config", "data["}
    for key in given_keys:
        names.update({key.strip(), repr(key)})
        for part in key.split("."):
            if part.strip():
                names.add(part.strip())
    return names


def assert_clear(exc: ConfigError, given_keys: list[str]) -> None:
    """Each problem reads ``name=value: why; fix`` and mentions one of the keys it was given."""
    assert exc.problems, "a ConfigError without problems"
    names = _names(given_keys)
    for problem in exc.problems:
        assert PROBLEM.match(problem), f"not 'name=value: why; fix': {problem!r}"
        assert len(problem) < 2000, f"a message of {len(problem)} characters"
        # Long names are shortened in messages: their first characters must appear.
        assert any(n[:40] in problem for n in names), f"{problem!r} names none of {sorted(names)}"


def _flat_keys(mapping: Any, prefix: str = "") -> list[str]:
    out: list[str] = []
    if isinstance(mapping, dict):
        for k, v in mapping.items():
            name = f"{prefix}{k}" if isinstance(k, str) else f"{prefix}{k!r}"
            out.append(name)
            out.extend(_flat_keys(v, name + "."))
    return out


def load_or_refuse(given_keys: list[str], *args: Any, **kwargs: Any) -> StaleboundConfig | None:
    """Load; a valid config comes back, or a clear ConfigError (then ``None``)."""
    try:
        config = load_config(*args, **kwargs)
    except ConfigError as exc:
        assert_clear(exc, given_keys)
        return None
    assert_valid(config)
    return config


# -- the properties --------------------------------------------------------------------------------


@SETTINGS
@given(st.dictionaries(keys(), values, max_size=5))
@example({"train": {"betas": [0.9]}})
@example({"train.weight_decay": math.nan})
@example({"rollout.request_timeout": 10**400})
@example({"rollout": {"max_head_offpolicyness": -(10**5000)}})
@example({"seed": 2**64})
def test_mappings_load_or_raise_a_clear_config_error(mapping: dict[str, Any]) -> None:
    before = copy.deepcopy(mapping)
    first = load_or_refuse(_flat_keys(mapping), data=[mapping])
    assert mapping == before, "load_config changed its input"
    second = load_or_refuse(_flat_keys(mapping), data=[mapping])
    assert first == second, "loading the same input twice gave two results"
    assert StaleboundConfig() == load_config(), "loading changed the defaults"


@SETTINGS
@given(st.lists(override_tokens, max_size=5))
@example(["rollout.request_timeout=" + "9" * 400])
@example(["seed=" + "9" * 5000])
@example(["engine.urls=" + "[" * 3000 + "]" * 3000])  # slow (2 s), so an example, not a draw
@example(["train.betas=[0.9]"])
@example(["train.entropy_coef=.nan"])
def test_overrides_load_or_raise_a_clear_config_error(tokens: list[str]) -> None:
    before = list(tokens)
    given_keys = [t.partition("=")[0] for t in tokens] + tokens
    load_or_refuse(given_keys, overrides=tokens)
    assert tokens == before, "load_config changed its input"


@SETTINGS
@given(
    st.lists(
        st.one_of(
            st.sampled_from(KEYS).map(lambda k: "--" + k.replace("_", "-")),
            keys().map(lambda k: "--" + k),
            override_tokens,
            value_texts,
            st.sampled_from(["--config", "-c", "--config=", "--", "-", "x.yaml", "--seed=1"]),
        ),
        max_size=6,
    )
)
def test_command_lines_split_or_raise_a_clear_config_error(argv: list[str]) -> None:
    before = list(argv)
    names = [*argv, *(a.lstrip("-").partition("=")[0].replace("-", "_") for a in argv)]
    try:
        paths, overrides = parse_cli_overrides(argv)
    except ConfigError as exc:
        assert_clear(exc, names)
        return
    finally:
        assert argv == before, "parse_cli_overrides changed its input"
    assert all(isinstance(p, str) for p in paths)
    # Only what the command line named is read: drop paths (the files need not exist).
    load_or_refuse(names, overrides=overrides)


@settings(SETTINGS, max_examples=80)
@given(yaml_texts)
@example("x: " + "[" * 3000 + "]" * 3000 + "\n")  # slow (2 s), so an example, not a draw
@example("?")  # an empty key: YAML reads it as null
def test_yaml_files_load_or_raise_a_clear_config_error(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hostile.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        words = re.findall(r"[^\s:]+", text)
        load_or_refuse(words, [path])
        load_or_refuse(words, [str(path)], ["seed=3"])


# -- regressions: each a bug the fuzzing found, written out ----------------------------------------


def problem(*args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    (text,) = info.value.problems
    return text


def test_an_integer_too_large_for_a_float_is_a_config_error() -> None:
    # Was OverflowError from float(int).
    assert problem(overrides=["rollout.request_timeout=" + "9" * 400]).startswith(
        "rollout.request_timeout=999"
    )


def test_an_integer_past_pythons_digit_limit_is_a_config_error() -> None:
    # Was ValueError from PyYAML's int() (4300-digit limit), and again from showing the value.
    assert "not a valid YAML value (Exceeds the limit" in problem(overrides=["seed=" + "9" * 5000])
    assert problem(data=[{"rollout": {"max_head_offpolicyness": -(10**5000)}}]) == (
        "rollout.max_head_offpolicyness=<an integer of 16610 bits>: must be a 64-bit integer "
        "(between -2**63 and 2**63 - 1); write a smaller number (default: 2)"
    )


def test_an_integer_beyond_64_bits_is_refused() -> None:
    # Was accepted, then broke dump_yaml (ValueError) and every seed consumer downstream.
    assert problem(data=[{"seed": 10**5000}]).startswith("seed=<an integer of 16610 bits>")
    assert problem(overrides=[f"seed={2**63}"]).startswith(f"seed={2**63}: must be a 64-bit")
    assert load_config(overrides=[f"seed={2**63 - 1}"]).seed == 2**63 - 1


def test_yaml_nested_too_deeply_is_a_config_error() -> None:
    # Was RecursionError out of PyYAML.
    text = problem(overrides=["engine.urls=" + "[" * 3000 + "]" * 3000])
    assert "not a valid YAML value (nested too deeply)" in text


def test_a_fixed_length_tuple_checks_its_length() -> None:
    # Was accepted as (0.9,), to fail later inside the optimizer.
    assert problem(overrides=["train.betas=[0.9]"]) == (
        "train.betas=[0.9]: must be a list of 2 items, not 1; write 2 values (default: [0.9, 0.99])"
    )
    assert load_config(overrides=["train.betas=[0.8, 0.9]"]).train.betas == (0.8, 0.9)


def test_nan_is_never_a_setting() -> None:
    # Was accepted for every float without a range rule (train.weight_decay, run.target_reward).
    assert problem(overrides=["train.weight_decay=.nan"]) == (
        "train.weight_decay=.nan: must be a number, not NaN; write a number (default: 0.0)"
    )
    assert load_config(overrides=["rollout.request_timeout=.inf"]).rollout.request_timeout == (
        math.inf
    )


def test_a_layer_that_is_not_a_mapping_is_a_config_error() -> None:
    # Was AttributeError ('list' object has no attribute 'items').
    assert problem(data=[[1, 2]]) == (
        "data[0]=[1, 2]: not a mapping; pass each layer as a mapping of keys to values"
    )


def test_tokens_that_are_not_strings_are_config_errors() -> None:
    # Were AttributeError (no .partition / .startswith).
    assert problem(overrides=typing.cast(list[str], [1])).startswith(
        "1=(missing): not a key=value override (of type int, not str)"
    )
    with pytest.raises(ConfigError, match=r"^1=\(missing\): a command-line argument must be"):
        parse_cli_overrides(typing.cast(list[str], [1]))
    with pytest.raises(ConfigError, match=r"--config=\(missing\): needs a path"):
        parse_cli_overrides(typing.cast(list[str], ["--config", 5]))
    assert problem(typing.cast(list[str], [5])).startswith("config=5: not a path")


def test_one_override_given_as_a_string_is_one_override() -> None:
    # Was read character by character ("s", "e", ... each "not a key=value override").
    assert load_config(overrides="seed=4").seed == 4


def test_returned_configs_share_nothing_with_the_defaults() -> None:
    first = load_config()
    first.engine.urls.append("http://mutated")
    first.rollout.proactive_filter.threshold = 99
    assert load_config() == StaleboundConfig()
    assert load_config().engine.urls == []
