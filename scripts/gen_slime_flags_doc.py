"""Write the generated tables of docs/coming-from-slime.md, each between its begin/end markers:
"slime flags not here" from `slime_async.config.slime_flags.NOT_HERE`, and "flags of slime's
scripts" from `slime_async.config.script_flags` (the model-shape flags, the run flags with the
values accepted, and `slime_flags.MEGATRON_NOT_HERE`). `--check` exits 1 when the doc is stale
instead of writing it (tests/test_slime_flags.py runs the same comparison)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from clifields import flag_name
from slime_async.config.model_shape import SHAPE_TABLE, ModelShapeFlags
from slime_async.config.script_flags import RUN_TABLE
from slime_async.config.slime_flags import MEGATRON_NOT_HERE, NOT_HERE

DOC = Path(__file__).resolve().parents[1] / "docs" / "coming-from-slime.md"
BEGIN = "<!-- slime-flags:begin (scripts/gen_slime_flags_doc.py writes this table) -->"
END = "<!-- slime-flags:end -->"
SCRIPT_BEGIN = "<!-- script-flags:begin (scripts/gen_slime_flags_doc.py writes this table) -->"
SCRIPT_END = "<!-- script-flags:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _flags(flags: list[str]) -> str:
    return ", ".join(f"`{f}`" for f in flags)


def _grouped(answers: dict[str, str]) -> list[str]:
    """One row per answer, with every flag that has it (in the table's order)."""
    rows: dict[str, list[str]] = {}
    for flag, answer in answers.items():
        rows.setdefault(answer, []).append(flag)
    return [f"| {_flags(flags)} | {_cell(answer)} |" for answer, flags in rows.items()]


def table() -> str:
    """The slime flags `train_async.py` does not take, each with its answer."""
    return "\n".join(["| slime | here |", "|---|---|", *_grouped(NOT_HERE)])


def script_table() -> str:
    """The flags of slime's scripts: the shape flags (checked), the run flags (accepted values
    and their meaning here), then the Megatron flags not taken."""
    shape = [flag_name(ModelShapeFlags, f.name) for f in dataclasses.fields(ModelShapeFlags)]
    lines = [
        "| flag | accepted | here |",
        "|---|---|---|",
        f"| {_flags(shape)} | equal to config.json | {_cell(SHAPE_TABLE)} |",
    ]
    for dest, answer in RUN_TABLE.items():
        accepts = answer.accepts or "refused"
        lines.append(f"| `--{dest.replace('_', '-')}` | {accepts} | {_cell(answer.here)} |")
    for row in _grouped(MEGATRON_NOT_HERE):
        flags, answer = row[2:].split(" | ", 1)
        lines.append(f"| {flags} | refused | {answer}")
    return "\n".join(lines)


def _between(doc: str, begin: str, end: str, body: str) -> str:
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render(doc: str) -> str:
    doc = _between(doc, BEGIN, END, table())
    return _between(doc, SCRIPT_BEGIN, SCRIPT_END, script_table())


def main() -> int:
    doc = DOC.read_text()
    new = render(doc)
    if "--check" in sys.argv[1:]:
        if new != doc:
            print(f"{DOC} is stale: run python scripts/gen_slime_flags_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
