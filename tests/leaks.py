"""What a test process holds (threads by name, open fds, child processes) and what it gained.

`held()` reads /proc/self: every thread's name (`comm`, so C++ threads count too: gloo's
`gloo_tcp_loop` / `pt_gloo_runloop`, gRPC's, torch's), every open fd's target, and every child
process (zombies too: a child not reaped is a leak). `gained(before, after)` names the growth in
a sentence per kind. tests/conftest.py checks the whole session with it, module by module.

Worked example: a test module that formed a gloo process group and never destroyed it gains
`gloo_tcp_loop x1, pt_gloo_runloop x2` and a few `socket` fds; 1,668 such groups gain 5,004
threads.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    threads: collections.Counter[str]
    """Thread name -> how many."""
    fds: collections.Counter[str]
    """fd kind (`socket`, `pipe`, `anon_inode:[eventpoll]`, a path's directory) -> how many."""
    children: dict[int, str]
    """Child pid -> its command line (`<zombie>` suffixed when not reaped)."""

    @property
    def n_threads(self) -> int:
        return sum(self.threads.values())

    @property
    def n_fds(self) -> int:
        return sum(self.fds.values())


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # the thread/process ended meanwhile
        return ""


def _fd_kind(target: str) -> str:
    if target.startswith("anon_inode:"):  # anon_inode:[eventfd], anon_inode:[eventpoll]
        return target
    if ":[" in target:  # socket:[inode], pipe:[inode]
        return target.split(":[", 1)[0]
    return os.path.dirname(target) or target


def held() -> Held:
    """This process's threads, fds and children now."""
    threads: collections.Counter[str] = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        name = _read(f"/proc/self/task/{tid}/comm").strip()
        if name:
            threads[name] += 1
    fds: collections.Counter[str] = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the fd listdir itself used
            fds[_fd_kind(os.readlink(f"/proc/self/fd/{fd}"))] += 1
    me, children = str(os.getpid()), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _read(f"/proc/{pid}/stat")
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == me:
            cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()[:160]
            children[int(pid)] = cmd + (" <zombie>" if fields[0] == "Z" else "")
    return Held(threads, fds, children)


def gained(before: Held, after: Held) -> list[str]:
    """One sentence per kind that grew (threads by name, fds by kind, new children)."""
    out = []
    if after.n_threads > before.n_threads:
        more = after.threads - before.threads
        names = ", ".join(f"{k} x{v}" for k, v in more.most_common(12))
        out.append(f"threads {before.n_threads} -> {after.n_threads} (+{names})")
    if after.n_fds > before.n_fds:
        more = after.fds - before.fds
        kinds = ", ".join(f"{k} x{v}" for k, v in more.most_common(8))
        out.append(f"open fds {before.n_fds} -> {after.n_fds} (+{kinds})")
    new = {p: c for p, c in after.children.items() if p not in before.children}
    if new:
        listed = "; ".join(f"pid {p}: {c}" for p, c in sorted(new.items())[:8])
        out.append(f"child processes {len(before.children)} -> {len(after.children)} ({listed})")
    return out
