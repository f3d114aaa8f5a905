"""The ``stalebound`` command line."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stalebound.obs.doctor import Prediction


def _walkthrough(_: argparse.Namespace) -> int:
    from stalebound import walkthrough

    walkthrough.run()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from stalebound import __version__

    parser = argparse.ArgumentParser(
        prog="stalebound", description="Bounded-staleness asynchronous RL for language models."
    )
    parser.add_argument("--version", action="version", version=f"stalebound {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    walk = sub.add_parser(
        "walkthrough",
        help="narrated walk through the staleness-buffer protocol",
        description=(
            "Walk through the Reserve / Occupy / Consume protocol on the worked example of the "
            "PSRL design: six trajectories start at version 0 with η = 1, move to the earliest "
            "buffer with room as they finish, and buffer 0 becomes READY first. The buffers are "
            "drawn after each step; no model is needed."
        ),
    )
    walk.set_defaults(func=_walkthrough)
    for name, help_text in (
        ("train", "train on the embedded default (stalebound train --help)"),
        ("bench", "the same run at several η side by side (stalebound bench --help)"),
        ("ablate", "η × objective × seed grid of final reward (stalebound ablate --help)"),
    ):
        sub.add_parser(name, help=help_text, description=f"{help_text[0].upper()}{help_text[1:]}.")
    audit = sub.add_parser(
        "audit",
        help="check that every item of a run is accounted for exactly once",
        description=(
            "Check a run's lineage against its newest checkpoint: every item the executor took "
            "in is trained, ended (filtered, failed, dropped, ...) or pending in the checkpoint "
            "exactly once, and its records (metrics.jsonl, staleness.jsonl, buffers.jsonl, "
            "ledger.jsonl) hold each step once. Exits 1 when not. With --data: the data audit "
            "instead (docs/audit.md), what was trained against what was offered, as a table "
            "and data_audit.png."
        ),
    )
    audit.add_argument("run_dir", help="a run directory with a checkpoint")
    audit.add_argument(
        "--data", action="store_true", help="audit the trained data against the offered"
    )
    audit.set_defaults(func=_audit)

    from stalebound.obs.cli import register as register_plot

    register_plot(sub)
    from stalebound.obs import doctor

    doctor.register(sub, predictor=_predict_gains)
    from stalebound.engines import vllm_server

    vllm_server.register(sub)
    from stalebound.sim import cli as sim_cli

    sim_cli.register(sub)
    return parser


def _train(argv: Sequence[str]) -> int:
    from stalebound.config.cli import train_config_or_status
    from stalebound.core.errors import ConfigError, StaleboundError

    print_config = "--print-config" in argv
    cfg = train_config_or_status(
        [a for a in argv if a != "--print-config"], TRAIN_HELP, "stalebound train: "
    )
    if isinstance(cfg, int):
        return cfg
    if print_config:
        from stalebound.config import dump_yaml

        sys.stdout.write(dump_yaml(cfg))
        return 0
    from stalebound.train.outcome import TrainingInterrupted
    from stalebound.train.recipe import run_training

    try:
        run_training(cfg)
    except TrainingInterrupted as e:
        print(f"stalebound train: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt as e:  # before the run took its directory: nothing was written
        signum = getattr(e, "signum", signal.SIGINT)  # SIGTERM while waiting for the servers
        print(
            f"stalebound train: {signal.Signals(signum).name} received: interrupted before the "
            "run started; nothing was written",
            file=sys.stderr,
        )
        return 128 + signum
    except ConfigError as e:  # found once the run starts (an unwritable run directory)
        print(f"stalebound train: {e}", file=sys.stderr)
        return 2
    except StaleboundError as e:  # a bad checkpoint, a full disk, a stopped executor
        print(f"stalebound train: {e}", file=sys.stderr)
        return 1
    return 0


def _audit(args: argparse.Namespace) -> int:
    from stalebound.core.errors import ConfigError, StaleboundError
    from stalebound.train.ledger import audit_run
    from stalebound.userfiles import label, readable_problem

    try:
        problem = readable_problem(
            args.run_dir,
            label("run_dir", args.run_dir),
            fix="give the directory of a run written by stalebound train",
        )
        if problem:
            raise ConfigError(problem)
        if args.data:
            from stalebound.obs.audit import print_data_audit

            return print_data_audit(args.run_dir)
        audit = audit_run(args.run_dir)
    except StaleboundError as e:
        print(f"stalebound audit: {e}", file=sys.stderr)
        return 2
    print(audit.describe())
    return 0 if audit.ok else 1


TRAIN_HELP = """usage: stalebound train [CONFIG.yaml ...] [key.path=value ...] [--flag VALUE ...]

Asynchronous GRPO on the embedded default: warm start, engines in worker processes, the
staleness buffer between them and the trainer. Every config key is an override (docs/config.md),
e.g. rollout.staleness=2 run.steps=40; the seeds' spellings work too:
--max-head-offpolicyness 4 --max-concurrent-rollouts 64, psrl.staleness=2 psrl.rollout_n=8.

Checkpoints go to RUN_DIR/checkpoints (run.checkpoint_every_steps, at the end, and on
SIGTERM/SIGINT). Continue a run with: stalebound train resume=RUN_DIR [run.steps=100 ...]

With engine.model_path naming your own checkpoint, the defaults suit a pretrained model
(train.lr 1e-6, no warm start, train.micro_batch_tokens 16384; docs/training.md); what you set
still wins.

  --print-config   print the fully resolved settings as YAML and exit (nothing is written)"""


EXTRAS = {
    "torch": "torch",
    "transformers": "torch",
    "tokenizers": "torch",
    "safetensors": "torch",
    "numpy": "torch",
    "matplotlib": "obs",
    "tensorboard": "obs",
    "prometheus_client": "obs",
    "ray": "ray",
    "httpx": "vllm",
    "wandb": "wandb",
    "mlflow": "mlflow",
}
"""The optional dependencies by the extra that installs them (pyproject.toml)."""


def _predict_gains(run_dir: str, causes: Sequence[str]) -> dict[str, Prediction | None]:
    from stalebound.sim.whatif import predict_gains  # loads the simulator: only when asked

    return predict_gains(run_dir, causes)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except ModuleNotFoundError as exc:  # an optional dependency the command needs
        top = (exc.name or "").partition(".")[0]
        if top not in EXTRAS:
            raise
        command = argv[0] if argv else "stalebound"
        print(
            f"stalebound {command}: needs {top}, which is not installed; install it with the "
            f"extra: pip install 'stalebound[{EXTRAS[top]}]'",
            file=sys.stderr,
        )
        return 2


def _run(argv: list[str]) -> int:
    if argv and argv[0] == "train":  # free-form overrides and AReaL-style flags: not argparse's
        return _train(argv[1:])
    if argv and argv[0] == "bench":
        from stalebound.train import bench

        return bench.main(argv[1:])
    if argv and argv[0] == "ablate":
        from stalebound.train import ablate

        return ablate.main(argv[1:])
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
