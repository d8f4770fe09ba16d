"""The design docs stay inside the repository and stay true to the code.

Checks, on the files themselves (no network, no git): every markdown link in the repository
points at a file or directory inside it that exists (and at a heading that exists, when it names
one); every file path a `docs/` page mentions exists; every rule doc names, under
"Where it lives", code locations whose files exist and whose named functions and classes occur
in those files; every `.md`/`.py`/`.yaml`/`.sh` file a Python docstring or comment names exists
in the repository; rule pages carry no work-item narrative; and a number measured on a
`docs/results/` page is not repeated on a rule page. A refactor that moves or renames what a doc
points at fails here until the doc is updated.
"""

from __future__ import annotations

import io
import os
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP_DIRS = {"node_modules", "__pycache__", "runs", "bench_out", "build", "dist", "venv"}
NOT_RULE_DOCS = {"README.md", "architecture.md"}

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
PATH_TOKEN = re.compile(r"^[\w-][\w.-]*(?:/[\w.-]+)*(?:\.(?:py|md|sh|toml|txt)|/)$")
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")
CODE_FILE = re.compile(r"\.(?:py|sh)$")


def markdown_files() -> list[Path]:
    """Every markdown file of the repository (hidden, virtualenv and output folders pruned)."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d for d in dirs if not (d.startswith(".") or d in SKIP_DIRS or d.endswith(".egg-info"))
        ]
        out += [Path(folder) / f for f in files if f.endswith(".md")]
    return sorted(out)


def prose_lines(text: str) -> list[str]:
    """Lines outside fenced code blocks, with inline code spans blanked out."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else line)
    return lines


def links(text: str) -> list[str]:
    found = []
    for line in prose_lines(text):
        bare = CODE_SPAN.sub("", line)
        found += INLINE_LINK.findall(bare)
        m = REF_DEF.match(bare)
        if m:
            found.append(m.group(1))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: rendered text, lower case, punctuation dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_problem(source: Path, target: str) -> str | None:
    """Why `target` (a link in `source`) is broken, or None when it resolves in the repo."""
    if SCHEME.match(target):
        return None  # a web address: not checked (no network in tests)
    path_part, _, anchor = target.partition("#")
    if path_part.startswith("/"):
        return "absolute path (use a path relative to the file)"
    dest = (source.parent / path_part).resolve() if path_part else source.resolve()
    try:
        dest.relative_to(ROOT)
    except ValueError:
        return "points outside the repository (a clone does not have it)"
    if not dest.exists():
        return "no such file or directory"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"no heading with anchor #{anchor} in {dest.relative_to(ROOT)}"
    return None


def test_markdown_files_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/README.md", "docs/architecture.md"} <= names


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_stay_inside_the_repository_and_resolve(md: Path) -> None:
    bad = []
    for target in links(md.read_text(encoding="utf-8")):
        why = link_problem(md, target)
        if why:
            bad.append(f"{target}: {why}")
    assert not bad, f"{md.relative_to(ROOT)} has broken links:\n  " + "\n  ".join(bad)


def test_link_checker_catches_what_it_should(tmp_path: Path) -> None:
    text = (
        "[ok](docs/README.md) [out](../shared/ARCHITECTURE.md) [abs](/etc/passwd)\n"
        "`[not a link](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n[web](https://x.org/a)\n"
        "[ref]: docs/missing.md\n[anchor](docs/architecture.md#no-such-heading)\n"
    )
    found = links(text)
    assert found == [
        "docs/README.md",
        "../shared/ARCHITECTURE.md",
        "/etc/passwd",
        "https://x.org/a",
        "docs/missing.md",
        "docs/architecture.md#no-such-heading",
    ]
    source = ROOT / "README.md"
    problems = {t: link_problem(source, t) for t in found}
    assert problems["docs/README.md"] is None and problems["https://x.org/a"] is None
    assert "outside the repository" in problems["../shared/ARCHITECTURE.md"]
    assert "absolute" in problems["/etc/passwd"]
    assert "no such file" in problems["docs/missing.md"]
    assert "no heading" in problems["docs/architecture.md#no-such-heading"]
    assert slug("The version/staleness contract") == "the-versionstaleness-contract"
    assert slug("Measured (`scripts/x.py`, 2 runs)") == "measured-scriptsxpy-2-runs"


def doc_paths(md: Path) -> list[str]:
    """Repository paths a docs page mentions in code spans (`data_worker/budget.py`, `loss/`)."""
    out = []
    for line in prose_lines(md.read_text(encoding="utf-8")):
        for span in CODE_SPAN.findall(line):
            token = span.strip("`")
            if "/" in token and PATH_TOKEN.match(token):
                out.append(token)
    return out


def code_locations(md: Path) -> list[tuple[str, list[str]]]:
    """(code file, names mentioned after it) from the page's "Where it lives" section."""
    lines = prose_lines(md.read_text(encoding="utf-8"))
    try:
        start = next(i for i, x in enumerate(lines) if x.strip() == "## Where it lives")
    except StopIteration:
        return []
    section = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        section.append(line)
    out: list[tuple[str, list[str]]] = []
    for span in CODE_SPAN.findall("\n".join(section)):
        token = span.strip("`")
        if "/" in token and PATH_TOKEN.match(token) and CODE_FILE.search(token):
            out.append((token, []))
        elif out and IDENT.match(token):
            out[-1][1].append(token)
    return out


DOC_PAGES = sorted(DOCS.glob("*.md")) if DOCS.is_dir() else []
RULE_DOCS = [p for p in DOC_PAGES if p.name not in NOT_RULE_DOCS]


@pytest.mark.parametrize("md", DOC_PAGES, ids=lambda p: p.name)
def test_every_path_a_doc_mentions_exists(md: Path) -> None:
    missing = [p for p in doc_paths(md) if not (ROOT / p).exists()]
    assert not missing, f"docs/{md.name} mentions paths that do not exist: {missing}"


def test_there_is_a_doc_per_control_rule() -> None:
    names = {p.name for p in RULE_DOCS}
    assert {
        "staleness-budget.md",
        "windowed-fifo.md",
        "length-probe-dispatch.md",
        "compis.md",
        "routing-replay.md",
        "weight-sync.md",
        "router-policy.md",
        "resume-guards.md",
    } <= names
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    unlisted = [p.name for p in DOC_PAGES if p.name != "README.md" and f"]({p.name})" not in index]
    assert not unlisted, f"docs/README.md does not list {unlisted}"


@pytest.mark.parametrize("md", RULE_DOCS, ids=lambda p: p.name)
def test_rule_doc_names_code_that_exists(md: Path) -> None:
    locations = code_locations(md)
    assert locations, f"docs/{md.name} has no '## Where it lives' section naming a code file"
    problems = []
    for rel, names in locations:
        path = ROOT / rel
        if not path.is_file():
            problems.append(f"{rel} does not exist")
            continue
        text = path.read_text(encoding="utf-8")
        for name in names:
            for part in name.split("."):
                if not re.search(rf"\b{re.escape(part)}\b", text):
                    problems.append(f"{rel} has no {part!r} (named as `{name}`)")
    assert not problems, f"docs/{md.name} 'Where it lives' is stale:\n  " + "\n  ".join(problems)


# ---------------------------------------------------------------- file names in Python prose

CODE_DIRS = ("slime_async", "loss", "data_worker", "router", "scripts", "tests")
CODE_REF = re.compile(
    r"(?<![\w./\-*{}$<~])((?:[\w.-]+/)*[\w-][\w.-]*\.(?:md|py|yaml|yml|sh))(?![\w/*{}-])"
)
# Files of other projects that a docstring names on purpose (not paths in this repository).
EXTERNAL_PREFIXES = ("slime/", "verl/", "areal/", "megatron/", "sglang/", "transformers/", "torch/")
NOT_REPO_FILES = {
    "FILE.yaml": "a placeholder in usage text",
    "dispatch.md": "written by scripts/simulate_dispatch.py under its --out directory",
    "run-qwen3-4B.sh": "slime's example launch script",
}


def python_files() -> list[Path]:
    out = [ROOT / "train_async.py"]
    for name in CODE_DIRS:
        for f in sorted((ROOT / name).rglob("*.py")):
            rel = f.relative_to(ROOT).parts
            if not any(p in SKIP_DIRS or p.startswith(".") for p in rel):
                out.append(f)
    return out


STATEMENT_START = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.NL)


def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring-position string of a Python source."""
    out = []
    prev = tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        docstring = tok.type == tokenize.STRING and prev in STATEMENT_START
        if tok.type == tokenize.COMMENT or docstring:
            out.append((tok.start[0], tok.string))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    return out


def repo_file_names() -> set[str]:
    names = set()
    for _folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d in SKIP_DIRS)]
        names.update(files)
    return names


def missing_file_refs(path: Path, source: str, names: set[str]) -> list[str]:
    """File names in `path`'s docstrings and comments that resolve to no file of the repository:
    tried from the root, from the file's folder and each folder above it, and as a bare name
    anywhere in the repository. Generated paths under runs/ are not checked."""
    bad = []
    bases = [ROOT, *[d for d in path.parents if ROOT in (d, *d.parents)]]
    for line, text in python_prose(source):
        for ref in CODE_REF.findall(text):
            if ref.startswith(("runs/", *EXTERNAL_PREFIXES)) or ref in NOT_REPO_FILES:
                continue
            if "/" not in ref and ref in names:
                continue
            if any((base / ref).exists() for base in bases):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: {ref}")
    return bad


def test_python_prose_names_only_files_that_exist() -> None:
    names = repo_file_names()
    bad = []
    for f in python_files():
        bad += missing_file_refs(f, f.read_text(encoding="utf-8"), names)
    assert not bad, "docstrings or comments name files that do not exist:\n  " + "\n  ".join(bad)


def test_file_reference_checker_catches_what_it_should() -> None:
    source = (
        '"""See docs/compis.md and loss/README.md, specs/compis-loss.md §3, cpu-stack.md."""\n'
        "x = 1  # writes config.json, metrics.jsonl and model.pt; runs/default/x.md is generated\n"
        "y = 'docs/not-a-docstring.md'\n"
        'def f():\n    """Loads recipes/F.yaml from slime/backends/loss.py."""\n'
    )
    bad = missing_file_refs(ROOT / "loss" / "example.py", source, repo_file_names())
    assert bad == [
        "loss/example.py:1: specs/compis-loss.md",
        "loss/example.py:1: cpu-stack.md",
        "loss/example.py:5: recipes/F.yaml",
    ]


# ---------------------------------------------------------------- rule pages: no narrative

NARRATIVE = re.compile(
    r"(?<![-\w])(?:issues?|sessions?)\b|\bthis change\b|\bprevious version of this page\b"
    r"|\b(?:the )?commit before\b|\bbase commit\b|\bstop notes?\b",
    re.IGNORECASE,
)


def narrative_hits(text: str) -> list[str]:
    return [line.strip() for line in prose_lines(text) if NARRATIVE.search(line)]


@pytest.mark.parametrize("md", DOC_PAGES, ids=lambda p: p.name)
def test_rule_pages_state_rules_without_work_history(md: Path) -> None:
    hits = narrative_hits(md.read_text(encoding="utf-8"))
    assert not hits, f"docs/{md.name} tells work history (keep that out of the docs):\n  " + (
        "\n  ".join(hits)
    )


def test_narrative_check_catches_what_it_should() -> None:
    assert narrative_hits("The issue asked for 16.\nRe-issue the prompt.\nAs before this change.")
    assert narrative_hits("the session's load") and not narrative_hits("re-issued groups")


# ---------------------------------------------------------------- numbers: one place each

RESULTS = DOCS / "results"
NUMBER = re.compile(
    r"(?<![\w.^/\-−])(\d+(?:\.\d+)?)\s?(%|×|ms\b|s\b|min\b|GB\b|MB\b|µs\b)?(?![\w.]*\d)"
)
# Constants a rule page states and a results page happens to contain too.
RULE_CONSTANTS = {
    "2.15": "a version bound (torch <2.15 in the install table)",
    "2×": "a product of sizes (TP 2 × DP 4) or a bound's factor",
    "5×": "the collapse rule of the stability verdicts",
    "10%": "the verdict rules' start window",
    "1.25": "the IS range guard's upper default",
    "120s": "the router's client timeout",
    "30s": "the health bound of a resend",
}


def measured_numbers(text: str) -> set[str]:
    """Numbers that look measured: decimals of three or more significant digits, and numbers
    with a unit (%, ×, ms, s, min, GB, MB, µs); outside code spans, code blocks and link targets."""
    out = set()
    for line in prose_lines(text):
        line = re.sub(r"\]\([^)]*\)", "]", CODE_SPAN.sub(" ", line))
        for m in NUMBER.finditer(line):
            number, unit = m.groups()
            if unit or ("." in number and len(number.replace(".", "").lstrip("0")) >= 3):
                out.add(number + (unit or ""))
    return out


def test_rule_pages_link_to_results_instead_of_repeating_numbers() -> None:
    results = set()
    for md in sorted(RESULTS.glob("*.md")):
        results |= measured_numbers(md.read_text(encoding="utf-8"))
    bad = []
    for md in [*DOC_PAGES, ROOT / "README.md"]:
        numbers = measured_numbers(md.read_text(encoding="utf-8"))
        repeated = sorted(numbers & results - set(RULE_CONSTANTS))
        if repeated:
            bad.append(f"{md.relative_to(ROOT)}: {repeated}")
    assert not bad, "numbers measured in docs/results/ repeated on a rule page:\n  " + (
        "\n  ".join(bad)
    )


def test_number_check_catches_what_it_should() -> None:
    found = measured_numbers("took **2 min 2 s**, 831 MB, r2 p99 1.04, 89%, `0.123` [x](a1.25.md)")
    assert found == {"2min", "2s", "831MB", "1.04", "89%"}
    assert not measured_numbers("S = 8, B = 64, lr 1e-5, version 0.16.1, step 40")


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    """`.ci/run` ends with exactly the README's test command (so CI measures what a user runs,
    and both print the slowest tests)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"^\.venv/bin/python -m pytest -m \"not slow\".*$", readme, re.M)
    assert command is not None, 'README.md shows no `pytest -m "not slow"` test command'
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    assert ci[-1] == command.group(0), f".ci/run ends with {ci[-1]!r}, README: {command.group(0)!r}"
    assert "--durations=15" in command.group(0)
