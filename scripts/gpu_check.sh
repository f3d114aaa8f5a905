#!/usr/bin/env bash
# Every GPU check in one command, within 10 minutes, printing its figures: the GPU tier (training,
# precision, serving, FSDP in bfloat16 on CUDA, a Ray rank actor holding a GPU) and the sharded
# trainer's memory per rank measured with max_memory_allocated (one rank; every GPU of the machine
# as ranks when it has two or more).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
bash scripts/bootstrap.sh dev,torch,obs,data,wandb,mlflow,peft,ray >/dev/null
status=0
timeout 420 .venv/bin/python -m pytest -q -m gpu tests/gpu -s || status=1
gpus=$(.venv/bin/python -c "import torch; print(torch.cuda.device_count())")
sizes="1"
if [ "$gpus" -ge 2 ]; then sizes="1 2"; fi
timeout 150 .venv/bin/python bench/sharded_memory.py --device cuda --world-sizes $sizes || status=1
exit $status
