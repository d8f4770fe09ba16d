"""The stability lab's analysis: a repository tool, not part of the runtime.

Owns what one run of the lab's grid is and how finished runs are read back and analysed
(`lab.analysis`), the goals its report checks the grid against (`lab.goals`), and the figure
and markdown it writes (`lab.report`). Used by `scripts/bench_stability.py`,
`scripts/calibrate_guards.py` and the tests, with the repository root on `sys.path`; it is not
installed with `slime_async` (pyproject's package list leaves it out).

May import `slime_async` (the metrics and their verdict rules); `slime_async`, `loss`,
`data_worker` and `router` must never import it. See docs/stability.md.
"""
