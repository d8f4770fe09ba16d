"""The stderr lines of a refused command line, as a user reads them: without the lines Ray
forwards late from the workers of an earlier run in the same process (e.g.
`(_BehaviorActorImpl pid=15165) warnings.warn(...)`), which land in whichever test reads
stderr next."""

from __future__ import annotations

import re

RAY_WORKER_LOG = re.compile(r"^(\x1b\[\d+m)?\(\w+ pid=\d+")
"""A line Ray forwards from a worker's log."""


def error_lines(err: str) -> list[str]:
    """`err`'s lines, stripped of Ray's forwarded worker-log lines."""
    return [x for x in err.strip().splitlines() if not RAY_WORKER_LOG.match(x)]
