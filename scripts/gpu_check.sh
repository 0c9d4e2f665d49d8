#!/usr/bin/env bash
# The project's stages on a lent GPU machine, in one device call (issue 60; docs/gpu.md says how):
#   make gpu-wheels     here, first: the wheels the image lacks, into .whl/
#   device run, carry [".whl"], command: GPU_KIND=nvidia-h100-x1 bash scripts/gpu_check.sh
# Each step has its own time limit, so one that hangs costs only its share of the call; results land in
# $OUT as each step ends: gpu-<kind>-<date>.json (everything), the steps' logs, the profile's table.
# GPU_CHECK_DRY=1 runs the same steps on the tiny config on this machine's CPU, with the project's
# environment (tests/test_gpu_check.py does, in make test).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${GPU_CHECK_DRY:-0}
OUT=${OUT:-.rlhf/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PREFECT_SERVER_ANALYTICS_ENABLED=false
if [ "$DRY" = 1 ]; then
    PY=${PYTHON:-.venv/bin/python}; KIND=${GPU_KIND:-cpu-dry}; SMALL=(--dry); TINY=(--tiny); LIMIT=1
else
    PY=python3; KIND=${GPU_KIND:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-')}
    SMALL=(); TINY=(); LIMIT=0
    ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run make gpu-wheels here and carry .whl"; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 2
    export PYTHONPATH=/tmp/site:$PWD
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
fi
"$PY" - <<'PY' || exit 2
import platform, torch, transformers, trl, accelerate, peft, pydantic, pandera, datasets
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "trl", trl.__version__, "accelerate", accelerate.__version__,
      "peft", peft.__version__, "pydantic", pydantic.__version__, "pandera", pandera.__version__,
      "datasets", datasets.__version__, "gpu", torch.cuda.is_available())
import importlib.metadata as md
from packaging.requirements import Requirement
from bench.gpu_wheels import CARRIED
for name in CARRIED:  # what the carried wheels require, against what is installed beside them
    for text in md.requires(name) or []:
        r = Requirement(text)
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            try:
                have = md.version(r.name)
            except md.PackageNotFoundError:
                have = None
            if have is None or not r.specifier.contains(have, prereleases=True):
                print(f"requirement not met: {name} needs {r}, found {have}")
PY

step() {  # step NAME SECONDS (SECONDS_DRY) COMMAND...: its output in $OUT/NAME.log, its exit status reported
    local name=$1 seconds=$2 dry_seconds=$3; shift 3
    [ "$LIMIT" = 1 ] && seconds=$dry_seconds
    echo "== $name (at most ${seconds} s)"
    timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee "$OUT/$name.log" | grep -vE "it/s\]|examples/s\]|Warning|warnings.warn|forward_call"
    echo "== $name: exit ${PIPESTATUS[0]}"
}
STEPS=${GPU_CHECK_STEPS:-kernels stages pytest}  # a later call may rerun some: GPU_CHECK_STEPS="stages"
read -ra PARTS <<< "${GPU_CHECK_PARTS:-3b update}"  # bench.gpu_stages --parts (demo and llama: issue 60's)
IFS=: read -ra VARIANTS <<< "${GPU_CHECK_VARIANTS:-full:full, compiled:lora}"  # bench.gpu_stages --variants
read -ra ENGINES <<< "${GPU_CHECK_ENGINES:-graphs graphs-fp32 eager}"  # bench.gpu --engines
[[ " $STEPS " == *" kernels "* ]] && step kernels 150 240 "$PY" -m bench.gpu --out "$OUT/kernels.json" \
    --parts ceilings decode --engines "${ENGINES[@]}" "${TINY[@]}"
[[ " $STEPS " == *" stages "* ]] && step stages 290 420 "$PY" -m bench.gpu_stages --out "$OUT/stages.json" \
    --parts "${PARTS[@]}" --variants "${VARIANTS[@]}" "${SMALL[@]}"
[[ " $STEPS " == *" pytest "* ]] && step pytest 80 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py

"$PY" - "$OUT" "$KIND" <<'PY'
import json, re, sys, time
from pathlib import Path
out, kind = Path(sys.argv[1]), sys.argv[2]
record = {"kind": kind, "date": time.strftime("%Y-%m-%d")}
for part in ("stages", "kernels"):
    path = out / f"{part}.json"
    record[part] = json.loads(path.read_text()) if path.exists() else {"error": f"no {path.name}: see {part}.log"}
log = out / "pytest.log"
summary = [line for line in (log.read_text().splitlines() if log.exists() else []) if re.search(r" (passed|failed|skipped|error)", line)]
record["pytest"] = {"summary": summary[-1] if summary else "no summary: see pytest.log"}
target = out / f"gpu-{kind}-{record['date']}.json"
target.write_text(json.dumps(record, indent=1) + "\n")
print("wrote", target, "pytest:", record["pytest"]["summary"])
PY
