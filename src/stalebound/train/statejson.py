"""The executor's state in a checkpoint, as JSON data: reading it back runs no code from the file.

:meth:`~stalebound.runtime.WorkflowExecutor.state_dict` holds plain data (dicts, lists, numbers,
strings) and a few record types of the project: the items of the task (``Sample``) and the
finished trajectories (``Trajectory`` of the task, the executor's ``Trajectory``, the group
tracker's ``MemberResult``). :func:`encode` turns that into JSON values, tagging what JSON cannot
say itself::

    {"$tuple": [...]}                       a tuple
    {"$map": [[key, value], ...]}           a dict whose keys are not all strings
    {"$type": "<name>", "fields": {...}}    a record of one of the types in TYPES

:func:`decode` rebuilds exactly those types and nothing else: a ``$type`` outside :data:`TYPES`
is refused. Values of any other type (tensors, numpy scalars, a workflow's own classes) cannot be
checkpointed; :func:`encode` refuses them naming where they sit in the state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from stalebound.core.errors import StaleboundError
from stalebound.core.groups import MemberId, MemberResult
from stalebound.runtime.results import Trajectory as Rollout
from stalebound.tasks.episode import Sample, Trajectory, Turn

__all__ = ["TYPES", "StateDataError", "decode", "encode"]


class StateDataError(StaleboundError, ValueError):
    """A value that is not checkpoint data, or data that does not decode; the message says where."""


def _types() -> dict[str, type]:
    kinds: tuple[type, ...] = (MemberId, MemberResult, Rollout, Sample, Trajectory, Turn)
    return {f"{t.__module__}.{t.__qualname__}": t for t in kinds}


TYPES: Mapping[str, type] = _types()
"""The record types a checkpoint may hold, by ``module.QualifiedName``."""
_NAMES = {t: name for name, t in TYPES.items()}


def _fields(obj: Any) -> dict[str, Any]:
    if isinstance(obj, tuple):  # a NamedTuple
        return dict(obj._asdict())  # type: ignore[attr-defined]
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


def encode(obj: Any, where: str = "state") -> Any:
    """``obj`` as JSON values (see the module docstring); raises :class:`StateDataError` naming
    the first value that is not data, e.g. ``state.pending[3][1]: a Tensor``."""
    if obj is None or isinstance(obj, bool | str):
        return obj if type(obj) in (bool, str) or obj is None else str(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):  # numpy's float64 included
        return float(obj)
    name = _NAMES.get(type(obj))
    if name is not None:
        fields = {k: encode(v, f"{where}.{k}") for k, v in _fields(obj).items()}
        return {"$type": name, "fields": fields}
    if type(obj) is list:
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return {"$tuple": [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        if all(type(k) is str and not k.startswith("$") for k in obj):
            return {k: encode(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {
            "$map": [
                [encode(k, f"{where} key"), encode(v, f"{where}[{k!r}]")] for k, v in obj.items()
            ]
        }
    raise StateDataError(
        f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be stored in a "
        "checkpoint, which holds data only (dicts, lists, strings, numbers and "
        "stalebound.tasks.Trajectory / Sample); return those from the workflow"
    )


def decode(data: Any, where: str = "state") -> Any:
    """Rebuild what :func:`encode` wrote; raises :class:`StateDataError` for anything else."""
    if isinstance(data, list):
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(data)]
    if not isinstance(data, dict):
        return data
    if "$tuple" in data and len(data) == 1 and isinstance(data["$tuple"], list):
        return tuple(decode(v, f"{where}[{i}]") for i, v in enumerate(data["$tuple"]))
    if "$map" in data and len(data) == 1 and isinstance(data["$map"], list):
        out: dict[Any, Any] = {}
        for i, pair in enumerate(data["$map"]):
            if not isinstance(pair, list) or len(pair) != 2:
                raise StateDataError(f"{where}: entry {i} of a $map is not a [key, value] pair")
            key = decode(pair[0], f"{where} key")
            try:
                out[key] = decode(pair[1], f"{where}[{key!r}]")
            except TypeError:
                raise StateDataError(f"{where}: the key {key!r} cannot be a dict key") from None
        return out
    if "$type" in data:
        name, fields = data.get("$type"), data.get("fields")
        kind = TYPES.get(name) if isinstance(name, str) else None
        if kind is None or set(data) != {"$type", "fields"} or not isinstance(fields, dict):
            raise StateDataError(
                f"{where}: {name!r} is not a record type a checkpoint holds (those are "
                f"{sorted(TYPES)})"
            )
        values = {k: decode(v, f"{where}.{k}") for k, v in fields.items()}
        try:
            return kind(**values)
        except (TypeError, ValueError, StaleboundError) as exc:
            raise StateDataError(f"{where}: not a valid {name} ({exc})") from None
    if any(k.startswith("$") for k in data):
        raise StateDataError(f"{where}: unknown tag among {sorted(data)}")
    return {k: decode(v, f"{where}[{k!r}]") for k, v in data.items()}
