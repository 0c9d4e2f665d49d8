"""The wheels the stages need on a lent GPU machine that its image lacks (issue 60).

    python -m bench.gpu_wheels            (or: make gpu-wheels)

The device machines run Python 3.12 with their own torch, transformers, accelerate, peft, pandas and
pyarrow, and reach no package index. What the stages import beyond that travels with the working tree as
wheels (the device tool's README: 64 MiB per call, the tree included). This downloads `CARRIED`, at the
versions of `locks/project.txt`, for CPython 3.12 on manylinux x86-64, into the ignored `.whl/`, and prints
their total size. `tests/test_gpu_check.py` checks `CARRIED` against what `stages/`, `rlhf/` and `schemas/`
import: every distribution they need, with its requirements, is in `IMAGE` or here, and nothing here is
unneeded. `scripts/gpu_check.sh` installs them on the machine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDER = REPO / ".whl"
LOCK = REPO / "locks" / "project.txt"
LIMIT = 64 * 2 ** 20
"""What one device call carries, the working tree included."""

IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate
tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split())
"""The distributions the device image ('cuda') holds, as the device tool's KINDS.md listed them on 2026-11-17."""

IMAGE_VERSIONS = {"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
                  "tokenizers": "0.23.2", "torch": "2.11.0", "transformers": "5.17.0"}
"""The versions KINDS.md's pip list gives for some of them."""

CARRIED = (
    "transformers",  # the image has 5.17; the stages run on the locked one
    "peft", "pandas",  # in the image too, at versions KINDS.md does not give: the locked ones, as the stages run here
    "trl", "datasets", "dill", "multiprocess",  # TRL's trainers and their datasets
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection",  # the configs
    "pandera", "typeguard",  # the data contracts
)
"""What the stages need that the image lacks, or holds at another or an unknown version, by distribution name."""

NOT_ON_THE_DEVICE = {
    "mlflow": "rlhf/tracking.py: the flow's side, not a stage's",
    "ray": "launch.engine ray only; the GPU check runs each stage in one process",
    "websockets": "stages/envs/remote/openenv_client.py: OpenEnv environment servers only (imported where one is used)",
    "openai": "stages/envs/agent.py: `environment.agent` only (imported where an agent program is used)",
}
"""Modules `stages/`, `rlhf/` or `schemas/` import that the GPU check does not use, and why."""


def locked_version(name: str, lock: Path = LOCK) -> str:
    """`name`'s version in the lock."""
    found = re.search(rf"^{re.escape(name)}==([^\s\\]+)", lock.read_text(), re.MULTILINE | re.IGNORECASE)
    if not found:
        raise SystemExit(f"{lock}: {name} is not pinned")
    return found.group(1)


def download(folder: Path = FOLDER) -> int:
    """Every `CARRIED` wheel, freshly, into `folder`; their total bytes."""
    shutil.rmtree(folder, ignore_errors=True)
    platforms = [arg for n in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014", "manylinux1")
                 for arg in ("--platform", f"{n}_x86_64")]
    pins = [f"{name}=={locked_version(name)}" for name in CARRIED]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder), *pins],
                   check=True)
    return sum(f.stat().st_size for f in folder.glob("*.whl"))


def main() -> None:
    total = download()
    for wheel in sorted(FOLDER.glob("*.whl")):
        print(f"{wheel.stat().st_size / 2 ** 20:7.2f} MiB  {wheel.name}")
    print(f"{total / 2 ** 20:7.2f} MiB in {len(CARRIED)} wheels, of the {LIMIT / 2 ** 20:.0f} MiB a device call "
          "carries with the working tree")
    if total > LIMIT / 2:
        raise SystemExit("the wheels take over half of what a device call carries")


if __name__ == "__main__":
    main()
