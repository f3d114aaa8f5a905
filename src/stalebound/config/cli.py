"""``python -m stalebound.config``: print the settings ``stalebound train`` runs with, or the
reference of every key."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from stalebound.config import StaleboundConfig, config_reference, dump_yaml
from stalebound.core.errors import StaleboundError
from stalebound.train.preflight import train_config

__all__ = ["HELP", "main", "train_config_or_status"]

HELP = """\
usage: python -m stalebound.config [CONFIG.yaml ...] [key.path=value ...] [--flag VALUE ...]
       python -m stalebound.config --reference

Print, as YAML, the settings `stalebound train` runs with given the same arguments, fully
resolved: the train recipe (stalebound/configs/train.yaml), then each YAML file, then the
key.path=value overrides and --flags; with resume=RUN_DIR, the run's own config.yaml takes the
recipe's place. Nothing is written and nothing starts; bad settings are listed all at once (exit 2).

  --reference   print the reference of every key and alias as Markdown (docs/config.md)
  -h, --help    print this help"""


def main(argv: Sequence[str] | None = None) -> int:
    """``--reference`` prints the reference; ``-h``/``--help`` this command's help; anything
    else is read as ``stalebound train``'s arguments and the resolved settings are printed."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--reference"]:
        sys.stdout.write(config_reference())
        return 0
    config = train_config_or_status(args, HELP)
    if isinstance(config, int):
        return config
    sys.stdout.write(dump_yaml(config))
    return 0


def train_config_or_status(
    argv: Sequence[str], help_text: str, prefix: str = ""
) -> StaleboundConfig | int:
    """The settings ``stalebound train`` runs with for ``argv``, or the exit status when there are
    none: 0 after printing ``help_text`` for ``-h``/``--help``, 2 after printing the one error
    (behind ``prefix``) to stderr."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text)
        return 0
    try:
        return train_config(argv)
    except StaleboundError as exc:
        print(f"{prefix}{exc}", file=sys.stderr)
        return 2
