"""What each trainer node sees of the paths a trainer rank needs at start, and the refusal of a
layout that cannot work, before the trainer is built.

Owns `check_trainer_paths`: no shared filesystem is assumed. For every trainer rank, a task in
that rank's own bundle (so on its node) looks at what the rank will read or write:

* the start weights (`--hf-checkpoint`, or the warm start the driver wrote into the run
  directory): a rank whose node does not hold the same directory (same file names and sizes)
  receives them from rank 0 over the trainer group instead (`TrainerGroup(hf_from_rank0=True)`);
  rank 0's node must hold them;
* the resume checkpoint (`--load`): every rank reads it, so every trainer node must see the
  checkpoint the driver checked (its `meta.json`, byte for byte);
* the checkpoint directory (`--save`): every rank writes its part into one directory, so every
  trainer node must see the file the driver writes there;
* the run directory: rank 0 writes the exported weights there for the driver's node to read, so
  rank 0's node must see it (a trainer group on the driver's node holds rank 0).

A layout that fails is refused with the node, the rank, the path and the fix (`NodePathError`).
`look` is the pure part (what one node sees), `decide` the rule; `check_trainer_paths` runs
`look` on each trainer bundle through Ray. Imports only Ray, `host` and the standard library.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from slime_async.host import file_sha256

PROBE_NAME = ".slime_async_node_probe"
"""The file the driver writes into `--save` for the nodes to look for (removed afterwards)."""


class NodePathError(RuntimeError):
    """A trainer rank's node cannot see a path it needs; the message names node, path and fix."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Wanted:
    """What the driver sees, for the nodes to compare with (None: not needed by this run)."""

    hf_dir: str | None = None
    hf_listing: tuple[tuple[str, int], ...] = ()
    load_meta: str | None = None
    """Path of the `meta.json` of the checkpoint `--load` resumes."""
    load_meta_sha256: str = ""
    save_probe: str | None = None
    """Path of the probe file written into `--save`."""
    save_probe_text: str = ""
    run_probe: str | None = None
    """Path of the probe file written into the run directory (rank 0 writes exports there)."""
    run_probe_text: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Seen:
    """What one node sees of `Wanted`."""

    node_ip: str
    hf_same: bool = True
    load_same: bool = True
    save_same: bool = True
    run_same: bool = True


def listing(d: str | Path) -> tuple[tuple[str, int], ...]:
    """Names and sizes of the files directly in `d` (empty when it is not a directory): what
    must match for two nodes to hold the same HF directory."""
    p = Path(d)
    if not p.is_dir():
        return ()
    return tuple(sorted((f.name, f.stat().st_size) for f in p.iterdir() if f.is_file()))


def look(w: Wanted, *, node_ip: str) -> Seen:
    """What this node sees of `w` (run on the node)."""

    def same_text(path: str, text: str) -> bool:
        try:
            return Path(path).read_text() == text
        except OSError:
            return False

    def same_sha(path: str, sha: str) -> bool:
        try:
            return file_sha256(path) == sha
        except OSError:
            return False

    return Seen(
        node_ip=node_ip,
        hf_same=w.hf_dir is None or (listing(w.hf_dir) == w.hf_listing and bool(w.hf_listing)),
        load_same=w.load_meta is None or same_sha(w.load_meta, w.load_meta_sha256),
        save_same=w.save_probe is None or same_text(w.save_probe, w.save_probe_text),
        run_same=w.run_probe is None or same_text(w.run_probe, w.run_probe_text),
    )


def decide(
    w: Wanted, seen: Sequence[Seen], *, hf_flag: str, load: str | None, save: str | None
) -> list[str]:
    """The rule: raises `NodePathError` for a layout that cannot work; returns the nodes whose
    ranks receive the start weights from rank 0 (they do not hold them; empty: none)."""
    problems = []
    if w.hf_dir is not None and not seen[0].hf_same:
        problems.append(
            f"trainer rank 0 on node {seen[0].node_ip} cannot read {hf_flag} {w.hf_dir} as the "
            "driver sees it (missing, or other files); rank 0 reads the start weights and sends "
            "them to the other ranks, so its node must hold them: copy the directory to that "
            "path on that node, or run the driver on rank 0's node"
        )
    if w.run_probe is not None and not seen[0].run_same:
        problems.append(
            f"trainer rank 0 on node {seen[0].node_ip} does not see the run directory "
            f"{Path(w.run_probe).parent} (a file the driver wrote there is missing on that "
            "node); rank 0 writes the exported weights there for the driver's node to read: "
            "give the driver's node room for a trainer rank (rank 0 then runs there), or put "
            "the run directory on a filesystem both nodes mount"
        )
    for r, s in enumerate(seen):
        if w.load_meta is not None and not s.load_same:
            problems.append(
                f"trainer rank {r} on node {s.node_ip} cannot see the checkpoint --load {load} "
                f"resumes ({w.load_meta} missing or different there); every rank reads it: put "
                "--load on a filesystem every trainer node mounts at the same path (or copy it "
                "there), or run the trainer on one node"
            )
        if w.save_probe is not None and not s.save_same:
            problems.append(
                f"trainer rank {r} on node {s.node_ip} does not see --save {save} (a file the "
                "driver wrote there is missing on that node); every rank writes its part of a "
                "checkpoint into that directory and a resume reads all of it: put --save on a "
                "filesystem every trainer node mounts at the same path, or run the trainer on "
                "one node"
            )
    if problems:
        raise NodePathError("; ".join(problems))
    return sorted({s.node_ip for s in seen if w.hf_dir is not None and not s.hf_same})


@ray.remote(num_cpus=0)
def _look_here(w: Wanted) -> Seen:
    return look(w, node_ip=ray.util.get_node_ip_address())


def check_trainer_paths(
    slots: Sequence[Any],
    *,
    hf_dir: str | Path | None,
    hf_flag: str,
    load_meta: Path | None,
    load: str | None,
    save: str | Path | None,
    run_dir: str | Path,
) -> list[str]:
    """Look at every trainer rank's paths on its node (`slots`: the ranks' placement `Slot`s,
    in rank order) and apply `decide`; returns the nodes whose ranks get the start weights from
    rank 0 (empty: every node holds them)."""
    probe = None
    if save is not None:
        Path(save).mkdir(parents=True, exist_ok=True)
        probe = Path(save).absolute() / PROBE_NAME
        probe.write_text(secrets.token_hex(16))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    run_probe = Path(run_dir).absolute() / PROBE_NAME
    run_probe.write_text(secrets.token_hex(16))
    try:
        w = Wanted(
            hf_dir=None if hf_dir is None else str(Path(hf_dir).absolute()),
            hf_listing=listing(hf_dir) if hf_dir is not None else (),
            load_meta=None if load_meta is None else str(load_meta.absolute()),
            load_meta_sha256=file_sha256(load_meta) if load_meta is not None else "",
            save_probe=None if probe is None else str(probe),
            save_probe_text=probe.read_text() if probe is not None else "",
            run_probe=str(run_probe),
            run_probe_text=run_probe.read_text(),
        )
        refs = [_look_here.options(**_in_bundle(s)).remote(w) for s in slots]
        seen = ray.get(refs, timeout=120)
    finally:
        run_probe.unlink(missing_ok=True)
        if probe is not None:
            probe.unlink(missing_ok=True)
    return decide(w, seen, hf_flag=hf_flag, load=load, save=None if save is None else str(save))


def _in_bundle(slot: Any) -> dict[str, Any]:
    opts = dict(slot.actor_options())
    opts.update(num_cpus=0, num_gpus=0)  # the bundle's rank is not started yet; ask for nothing
    return opts
