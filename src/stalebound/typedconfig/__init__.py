"""Typed configuration trees: load any tree of dataclasses from YAML layers and dotted overrides.

The machinery behind :mod:`stalebound.config`, generic over the root dataclass so every section of
the tree gets parsing, conversion, validation, aliases, CLI flags, dumping and reference docs without
code of its own.

* A *layer* is one YAML file, one mapping, or the list of ``key.path=value`` overrides. Layers are
  applied in order; a later layer replaces what an earlier one set, key by key.
* Values are parsed by PyYAML; the conversion to each field's declared type is done here and is
  strict: ``"abc"`` is never an integer, ``4.0`` is not an integer, an integer is accepted for a float.
* Supported field types: ``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, ``X | None``,
  unions, ``list[X]``, ``tuple[X, ...]``, ``dict[str, X]``, ``Any``, and nested dataclasses (as
  sections, optional sections, or list items).
* Validation rules live next to the fields: :func:`bounds` and :func:`null_means` in a field's
  ``metadata``, and a ``_validate(self) -> Iterable[Invalid]`` method on a dataclass for rules that
  involve several fields. Every problem is collected and raised at once in one
  :class:`~stalebound.core.errors.ConfigError`, each as ``name=value: why; the fix``.

The package, module by module: :mod:`~stalebound.typedconfig.fields` (the rules declared next to
the fields, and what their types say), :mod:`~stalebound.typedconfig.schema` (the keys of a tree,
merging layers, converting and checking values), :mod:`~stalebound.typedconfig.layers` (YAML
files, overrides, command lines), :mod:`~stalebound.typedconfig.yamlload` (YAML read within
limits), :mod:`~stalebound.typedconfig.values` (values in messages and dumps),
:mod:`~stalebound.typedconfig.suggest` (the did-you-mean of an unknown key) and
:mod:`~stalebound.typedconfig.reference` (the reference documentation).
"""

from stalebound.typedconfig.fields import Bounds, Invalid, bounds, null_means, problems_as_invalid
from stalebound.typedconfig.layers import file_layer, override_layer, parse_argv
from stalebound.typedconfig.reference import field_docs, reference_tables
from stalebound.typedconfig.schema import Layer, Problems, Schema, Switch, check
from stalebound.typedconfig.suggest import suggest
from stalebound.typedconfig.values import dump_yaml, show, to_plain
from stalebound.typedconfig.yamlload import MAX_YAML_BYTES, MAX_YAML_VALUES, read_yaml

__all__ = [
    "MAX_YAML_BYTES",
    "MAX_YAML_VALUES",
    "Bounds",
    "Invalid",
    "Layer",
    "Problems",
    "Schema",
    "Switch",
    "bounds",
    "check",
    "dump_yaml",
    "field_docs",
    "file_layer",
    "null_means",
    "override_layer",
    "parse_argv",
    "problems_as_invalid",
    "read_yaml",
    "reference_tables",
    "show",
    "suggest",
    "to_plain",
]
