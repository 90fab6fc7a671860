#!/usr/bin/env bash
# `localspec gpucheck` on a lent CUDA machine that has torch but not this project's pinned
# transformers, bitsandbytes or gguf, and no network. Beforehand, on a machine with PyPI:
#   pip download --no-deps --python-version 3.12 --only-binary=:all: \
#       --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
#       transformers==5.24.0 bitsandbytes==0.50.2 gguf==0.19.0 -d .whl     # ~55 MB
# then run this script from the repository root with .whl/ carried along. The report lands
# in $OUT (the device tool's output folder), else in docs/. Extra arguments go to gpucheck.
set -euo pipefail
if compgen -G ".whl/*.whl" > /dev/null; then
    rm -rf /tmp/site
    pip install --quiet --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH=".:${PYTHONPATH:-}"
python - <<'PY'
import importlib.util
needed = ("torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "pydantic",
          "scipy", "gguf", "psutil", "tqdm", "numpy", "bitsandbytes")
print("missing modules:", [m for m in needed if importlib.util.find_spec(m) is None] or "none")
PY
timeout 540 python -m localspec gpucheck --out "${OUT:-docs}" "$@"
