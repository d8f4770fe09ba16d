"""Write the "slime flags not here" table of docs/coming-from-slime.md from
`slime_async.config.slime_flags` (between its begin/end markers); `--check` exits 1 when the doc is
stale instead of writing it (tests/test_slime_flags.py runs the same comparison)."""

from __future__ import annotations

import sys
from pathlib import Path

from slime_async.config.slime_flags import NOT_HERE

DOC = Path(__file__).resolve().parents[1] / "docs" / "coming-from-slime.md"
BEGIN = "<!-- slime-flags:begin (scripts/gen_slime_flags_doc.py writes this table) -->"
END = "<!-- slime-flags:end -->"


def table() -> str:
    """One row per answer, with every slime flag that has it (in the table's order)."""
    rows: dict[str, list[str]] = {}
    for flag, answer in NOT_HERE.items():
        rows.setdefault(answer, []).append(flag)
    lines = ["| slime | here |", "|---|---|"]
    for answer, flags in rows.items():
        cell = answer.replace("|", "\\|")
        lines.append(f"| {', '.join(f'`{f}`' for f in flags)} | {cell} |")
    return "\n".join(lines)


def render(doc: str) -> str:
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


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
