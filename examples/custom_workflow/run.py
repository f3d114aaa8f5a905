"""Train with the workflow of workflow.py from Python.

    python examples/custom_workflow/run.py [YAML files] [key=value overrides]

The settings are what ``stalebound train`` would use (its recipe: the embedded tiny model on the
arithmetic task), with this example's workflow and a short run; the arguments apply on top.
"""

import sys
from pathlib import Path

import stalebound

HERE = Path(__file__).resolve().parent


def main(argv):
    try:
        cfg = stalebound.train_config(
            [
                f"rollout.workflow={HERE / 'workflow.py'}:SecondChance",
                "rollout.workflow_args={max_turns: 2, discount: 0.5}",
                "run.steps=10",
                *argv,
            ]
        )
        result = stalebound.run_training(cfg)
    except stalebound.ConfigError as e:
        print(f"run.py: {e}", file=sys.stderr)
        return 2
    print(
        f"{result.steps} steps in {result.run_dir}: reward {result.reward_first:.3f} -> "
        f"{result.reward_last:.3f}, largest staleness {result.max_staleness}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
