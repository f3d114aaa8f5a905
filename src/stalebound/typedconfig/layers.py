"""The layers of settings a user gives: YAML files, ``key.path=value`` overrides, and a command
line of files, overrides and ``--flags``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from stalebound.core.errors import ConfigError
from stalebound.typedconfig.schema import Layer, Schema
from stalebound.typedconfig.suggest import suggest
from stalebound.typedconfig.values import show, visible
from stalebound.typedconfig.yamlload import TooLarge, read_yaml, yaml_error, yaml_load

__all__ = ["file_layer", "override_layer", "parse_argv"]


_LARGE_FIX = (
    "keep only settings in it (a config is a few kilobytes), and give large data as a file of "
    "its own (task.data_path)"
)


def file_layer(path: str | Path, problems: list[str]) -> Layer | None:
    """The layer of one YAML file, or ``None`` with the problem appended."""
    given: object = path  # callers outside the type checker may pass anything
    if not isinstance(given, (str, Path)):
        problems.append(
            f"config={show(given, 80)}: not a path; give the YAML file's path as a string"
        )
        return None
    try:
        data = read_yaml(path, f"config={path}", fix="check the path", large_fix=_LARGE_FIX)
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None
    if data is None:
        return Layer({})
    if not isinstance(data, Mapping):
        problems.append(
            f"config={path}: the file holds {show(data, 40)}, not a mapping; "
            "write one key: value per line at the top level"
        )
        return None
    return Layer(data)


def override_layer(overrides: Iterable[str], problems: list[str]) -> Layer:
    """The layer of ``key.path=value`` overrides; each value is parsed as YAML."""
    pairs: dict[str, Any] = {}
    tokens: Iterable[object] = overrides  # callers outside the type checker may pass anything
    for given in tokens:
        if not isinstance(given, str):
            problems.append(
                f"{show(given, 80)}=(missing): not a key=value override (of type "
                f"{type(given).__name__}, not str); write it as key.path=value"
            )
            continue
        token = given
        key, eq, text = token.partition("=")
        key = key.strip()
        if not eq or not key:
            problems.append(
                f"{visible(token)}=(missing): not a key=value override; write it as "
                "key.path=value, "
                "like rollout.group_size=8"
            )
            continue
        if not text.strip():
            key = visible(key)
            problems.append(
                f"{key}=: empty value; write {key}=null for null or {key}='' for an empty string"
            )
            continue
        short = text if len(text) <= 80 else text[:79] + "…"
        try:
            value = yaml_load(text)
        except TooLarge as exc:
            problems.append(f"{key}={short}: {exc}; give a shorter value")
            continue
        except yaml.YAMLError as exc:
            problems.append(
                f"{key}={short}: not a valid YAML value ({yaml_error(exc)}); "
                f"quote it: {key}='{short}'"
            )
            continue
        # A stray '#' starts a YAML comment; treat a value that parses to nothing as literal text
        # unless it is one of YAML's spellings of null.
        if value is None and text.strip() not in ("null", "Null", "NULL", "~"):
            value = text
        # Re-inserting keeps the last occurrence in its latest position (last one wins).
        pairs.pop(key, None)
        pairs[key] = value
    return Layer(pairs, overrides=True)


def parse_argv(argv: Sequence[str], schema: Schema) -> tuple[list[str], list[str]]:
    """Split a command line into YAML paths and ``key=value`` overrides (see config docs)."""
    paths: list[str] = []
    overrides: list[str] = []
    problems: list[str] = []
    flags = [f"--{s.replace('_', '-')}" for s in schema.spellings()]
    i = 0
    while i < len(argv):
        given: object = argv[i]
        i += 1
        if not isinstance(given, str):
            problems.append(
                f"{show(given, 80)}=(missing): a command-line argument must be a string, not of type "
                f"{type(given).__name__}; pass str tokens"
            )
            continue
        token = given
        if token in ("--config", "-c") or token.startswith("--config="):
            if token.startswith("--config="):
                paths.append(token.partition("=")[2])
            elif i < len(argv) and isinstance(argv[i], str):
                paths.append(argv[i])
                i += 1
            else:
                problems.append(f"{token}=(missing): needs a path; write {token} CONFIG.yaml")
            continue
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            if not eq:
                following = argv[i] if i < len(argv) else None
                if isinstance(following, str) and not following.startswith("--"):
                    value = following
                    i += 1
                else:
                    flag = visible(f"--{name}")
                    problems.append(
                        f"{flag}=(missing): needs a value; write {flag} VALUE or {flag}=VALUE"
                    )
                    continue
            key = name.replace("-", "_")
            if not schema.knows(tuple(key.split("."))):
                match = suggest(f"--{name}", flags, schema.synonyms)
                fix = (
                    f"did you mean {match}?"
                    if match
                    else (
                        "use a known flag or key.path=value"
                        + (f" ({schema.reference_hint})" if schema.reference_hint else "")
                    )
                )
                problems.append(f"{visible('--' + name)}={visible(value)}: unknown flag; {fix}")
                continue
            overrides.append(f"{key}={value}")
        elif "=" in token:
            overrides.append(token)
        elif token.endswith((".yaml", ".yml")) and not token.startswith("-"):
            paths.append(token)
        else:
            problems.append(
                f"{visible(token)}=(missing): neither a YAML file nor key=value; give a "
                ".yaml/.yml path, "
                "key.path=value, or --flag VALUE"
            )
    if problems:
        raise ConfigError(problems)
    return paths, overrides
