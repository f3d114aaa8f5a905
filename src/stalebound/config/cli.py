"""``python -m stalebound.config``: print the settings ``stalebound train`` runs with, or the
reference of every key."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from stalebound.config import config_reference, dump_yaml
from stalebound.core.errors import StaleboundError
from stalebound.train.preflight import train_config

__all__ = ["HELP", "main"]

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
    if any(a in ("-h", "--help") for a in args):
        print(HELP)
        return 0
    try:
        config = train_config(args)
    except StaleboundError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    sys.stdout.write(dump_yaml(config))
    return 0
