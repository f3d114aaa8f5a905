#!/usr/bin/env bash
# Create (or reuse) .venv and install stalebound with the extras the given target needs.
# Usage: scripts/bootstrap.sh [EXTRAS]   (default: dev,torch,obs,data,wandb,mlflow,peft)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev,torch,obs,data,wandb,mlflow,peft}"
py="${PYTHON:-python3}"
stamp=".venv/.stalebound-installed-${extras//,/-}"
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints-dev.txt -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch first, pinned: a bare requirement could pull a multi-GB CUDA build.
    if [[ ",$extras," == *",torch,"* ]]; then
        .venv/bin/python -m pip install -q -c constraints-dev.txt "torch==2.13.0" numpy
    fi
    .venv/bin/python -m pip install -q -c constraints-dev.txt -e ".[${extras}]"
    touch "$stamp"
fi
