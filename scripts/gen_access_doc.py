"""Write the access table of docs/security.md from `router.access.ACCESS` (between its
begin/end markers): every route of the engine, the router and the training gateway, the key it
needs and what each credential gets. `--check` exits 1 when the doc is stale instead of writing
it (tests/test_access_probe.py runs the same comparison and sends every route against
`ACCESS`)."""

from __future__ import annotations

import sys
from pathlib import Path

from router.access import ACCESS, CREDENTIALS, Privilege, expected

DOC = Path(__file__).resolve().parents[1] / "docs" / "security.md"
BEGIN = "<!-- access-table:begin (scripts/gen_access_doc.py writes this table) -->"
END = "<!-- access-table:end -->"
_NEEDS = {
    Privilege.PROBE: "nothing (a probe)",
    Privilege.DATA: "the data-plane key",
    Privilege.ADMIN: "the admin key",
}
_HEAD = {"none": "no key", "data": "data-plane key", "admin": "admin key", "wrong": "a wrong key"}


def table() -> str:
    """One row per server and privilege, with every route of it, and each credential's
    outcome (`expected`): 401, or ✓ (the route's own answer)."""
    groups: dict[tuple[str, Privilege], list[str]] = {}
    for (server, path), priv in ACCESS.items():
        groups.setdefault((server, priv), []).append(path)
    cols = " | ".join(_HEAD[c] for c in CREDENTIALS)
    lines = [f"| server | routes | needs | {cols} |", "|---|---|---|" + "---|" * len(CREDENTIALS)]
    for (server, priv), paths in groups.items():
        cells = " | ".join(
            "✓" if expected(priv, c) == "open" else expected(priv, c) for c in CREDENTIALS
        )
        routes = ", ".join(f"`{p}`" for p in paths)
        lines.append(f"| {server} | {routes} | {_NEEDS[priv]} | {cells} |")
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
            print(f"{DOC} is stale: run python scripts/gen_access_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
