#!/usr/bin/env bash
# flowrl's engines on a CUDA GPU (vLLM, Megatron-core in bf16, GPU weight sync, the GRPO job
# on the Megatron trainer): one command, one JSON object on stdout (tools/gpu_check.py says
# what each section checks). Without a GPU it prints {"gpu": false, ...} and exits 0.
#
#   tools/gpu_check.sh                 # python3 (or $PYTHON) with a CUDA torch
#
# What flowrl needs beside the machine's torch is installed into a private folder
# ($GPU_CHECK_SITE, default /tmp/flowrl-gpu-site), never into the interpreter: from wheels
# in .whl/ when that folder exists (a machine without a package index; download them with
# `pip download --python-version 3.12 --only-binary=:all: -d .whl megatron-core==0.16.1
# pyzmq msgspec`), else from the index. vLLM is used when the interpreter has it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo '{"gpu": false, "skipped": "no CUDA GPU (torch.cuda.is_available() is False or torch is missing)"}'
  exit 0
fi
SITE=${GPU_CHECK_SITE:-/tmp/flowrl-gpu-site}
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"zmq": "pyzmq", "msgspec": "msgspec", "megatron": "megatron-core==0.16.1",
        "pyarrow": "pyarrow", "transformers": "transformers", "pytest": "pytest",
        "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis"}
print(" ".join(pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
  if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl >&2 || exit 2
  else
    "$PY" -m pip install -q --no-deps --target "$SITE" $missing >&2 || exit 2
  fi
fi
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 480 "$PY" tools/gpu_check.py
