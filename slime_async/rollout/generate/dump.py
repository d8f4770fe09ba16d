"""Rollout dumps: what one step sampled and trained, as a checksummed JSON file (slime's
`--save-debug-rollout-data` / `--load-debug-rollout-data`), and the batch read back from it.

Owns `dump_path` (the file of a rollout id: a path template with `{rollout_id}`, or a
directory holding `<rollout_id>.json`), `check_dump_path`, `dump_record` (a scored `Batch` ->
the JSON-able record), `batch_of` (the record -> the same `Batch`), `write_dump` (atomic:
a temporary file renamed into place), `write_step` (both, for one step), `read_dump` (the
checksum verified) and `DumpError`.
Never imports the trainer, engine or controller; nothing is pickled.

A file is ``{"sha256": H, "body": BODY}``, H the SHA-256 of BODY serialized canonically
(sorted keys, no spaces; NaN and infinities as JSON's `NaN`/`Infinity` extension). BODY:

* `format` ("slime-async rollout dump"), `version` (`FORMAT_VERSION`), `rollout_id` (the
  train step), `trainer_version` (k, the version the batch was taken at);
* `drops`: groups dropped while this batch was taken, by reason (`stale`: k - j_min past
  --max-off-policy-steps; `filtered`: the group filter, --dynamic-sampling);
* `groups`: per group its prompt (`key`, `prompt_ids`, `payload` with the label, `text`),
  `seq`, `min_version`, `max_version`, `admitted_version`, `completed_at`, and `samples`: per
  sample `index`, `response_ids`, `response_text`, `token_versions` (one per response token),
  `logprobs` (the engine's, one per token), `reward`, `reward_status`, `masked` (why it is out
  of the loss: its reward status, else null), `attempts`, and `segments`: each generate
  segment's payload as the engine client and scoring wrote it (log-probs, finish reason,
  loss mask, routed experts as base64 int32 with their shape, π_j^Meg, ...);
* `trained`: the metrics of the train step on it (`loss/total`, `train/grad_norm`, ...), or
  null (not trained: `--debug-rollout-only`, or the step failed).

`batch_of` rebuilds the `Batch` exactly (ids, versions, float log-probs and rewards round-trip
through JSON unchanged), so `assemble` gives the trainer the same `TrainerBatch` again.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_worker.versions import VersionRuns
from slime_async.contracts.rollout import Batch, Group, Prompt, Sample
from slime_async.host import atomic_write_text

FORMAT = "slime-async rollout dump"
FORMAT_VERSION = 1
_ARRAY = "__ndarray__"


class DumpError(ValueError):
    """A dump that cannot be read (missing, torn, altered, another format): the message names
    the file and the fix."""


def dump_path(spec: str, rollout_id: int) -> Path:
    """The file of `rollout_id`: `spec` formatted when it is a template (slime's, with
    `{rollout_id}`), else `spec/<rollout_id>.json`."""
    if "{" in spec:
        return Path(spec.format(rollout_id=rollout_id))
    return Path(spec) / f"{rollout_id}.json"


def check_dump_path(spec: str, *, flag: str) -> None:
    """Refuse a template `dump_path` cannot fill, or files named as slime's pickles (.pt)."""
    try:
        name = dump_path(spec, 0)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"{flag} {spec}: a path template may hold only {{rollout_id}} ({e!r}); or give a "
            "directory"
        ) from None
    if name.suffix in (".pt", ".pth", ".pkl"):
        raise ValueError(
            f"{flag} {spec}: dumps here are JSON with a checksum (nothing is pickled), not "
            f"torch files; name them .json (e.g. {name.with_suffix('.json')}) or give a directory"
        )


def dump_record(
    batch: Batch,
    *,
    rollout_id: int,
    decode: Callable[[Sequence[int]], str] | None = None,
    trained: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The dump's body of the scored `batch` of step `rollout_id` (see the module docstring);
    `decode` adds the texts, `trained` the train step's metrics."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "rollout_id": rollout_id,
        "trainer_version": batch.current_version,
        "drops": {"stale": batch.dropped, "filtered": batch.filtered},
        "wait_s": batch.wait_s,
        "end_of_data": batch.end_of_data,
        "groups": [_group(g, decode) for g in batch.groups],
        "trained": None if trained is None else {k: float(v) for k, v in trained.items()},
    }


def _group(g: Group, decode: Callable[[Sequence[int]], str] | None) -> dict[str, Any]:
    prompt = g.prompt.to_json()
    prompt["text"] = decode(list(g.prompt.prompt_ids)) if decode is not None else None
    return {
        "seq": g.seq,
        "prompt": prompt,
        "min_version": g.min_version,
        "max_version": g.max_version,
        "admitted_version": g.admitted_version,
        "completed_at": g.completed_at,
        "samples": [_sample(s, decode) for s in g.samples],
    }


def _sample(s: Sample, decode: Callable[[Sequence[int]], str] | None) -> dict[str, Any]:
    last = s.payloads[-1]
    status = str(last.get("reward_status", "ok"))
    return {
        "index": s.sample_index,
        "response_ids": [int(t) for t in s.output_ids],
        "response_text": decode(list(s.output_ids)) if decode is not None else None,
        "token_versions": list(s.token_versions),
        "logprobs": [float(x) for p in s.payloads for x in p.get("logprobs", ())],
        "reward": last.get("reward"),
        "reward_status": status,
        "masked": None if status == "ok" else f"reward: {status}",
        "min_version": s.min_version,
        "attempts": s.attempts,
        "segments": [{k: _value(v) for k, v in p.items()} for p in s.payloads],
    }


def _value(v: Any) -> Any:
    """A payload value as JSON: arrays as base64 with dtype and shape, numpy scalars as numbers."""
    if isinstance(v, np.ndarray):
        data = base64.b64encode(np.ascontiguousarray(v).tobytes()).decode("ascii")
        return {_ARRAY: {"dtype": v.dtype.str, "shape": list(v.shape), "data": data}}
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, list | tuple):
        return [_value(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _value(x) for k, x in v.items()}
    return v


def _unvalue(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {_ARRAY}:
        a = v[_ARRAY]
        flat = np.frombuffer(base64.b64decode(a["data"]), dtype=np.dtype(a["dtype"]))
        return flat.reshape(a["shape"]).copy()
    return v


def batch_of(body: Mapping[str, Any]) -> Batch:
    """The `Batch` a dump's body holds (`dump_record`'s inverse)."""
    groups = []
    for g in body["groups"]:
        samples = tuple(
            Sample(
                sample_index=int(s["index"]),
                output_ids=list(s["response_ids"]),
                token_versions=VersionRuns.from_sequence(s["token_versions"]),
                payloads=tuple({k: _unvalue(v) for k, v in p.items()} for p in s["segments"]),
                min_version=int(s["min_version"]),
                attempts=int(s["attempts"]),
            )
            for s in g["samples"]
        )
        prompt = {k: v for k, v in g["prompt"].items() if k != "text"}
        groups.append(
            Group(
                seq=int(g["seq"]),
                prompt=Prompt.from_json(prompt),
                samples=samples,
                min_version=int(g["min_version"]),
                max_version=int(g["max_version"]),
                admitted_version=int(g["admitted_version"]),
                completed_at=float(g["completed_at"]),
            )
        )
    return Batch(
        groups=tuple(groups),
        dropped=int(body["drops"]["stale"]),
        filtered=int(body["drops"]["filtered"]),
        current_version=int(body["trainer_version"]),
        wait_s=float(body["wait_s"]),
        end_of_data=bool(body["end_of_data"]),
    )


def _canonical(body: Mapping[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)


def write_dump(path: Path, body: Mapping[str, Any]) -> None:
    """Write `body` with its checksum to `path` atomically (its directory made)."""
    text = _canonical(body)
    digest = hashlib.sha256(text.encode()).hexdigest()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, f'{{"sha256":"{digest}","body":{text}}}\n')


def write_step(
    spec: str,
    batch: Batch,
    *,
    rollout_id: int,
    decode: Callable[[Sequence[int]], str] | None = None,
    trained: Mapping[str, float] | None = None,
) -> Path:
    """`--save-debug-rollout-data SPEC`: the dump of step `rollout_id` written where `spec`
    says (`dump_record`, `write_dump`); returns the file."""
    path = dump_path(spec, rollout_id)
    write_dump(path, dump_record(batch, rollout_id=rollout_id, decode=decode, trained=trained))
    return path


def read_dump(path: Path) -> dict[str, Any]:
    """The body of the dump at `path`, its checksum and format checked (`DumpError`)."""
    if not path.is_file():
        raise DumpError(f"no rollout dump at {path}")
    try:
        doc = json.loads(path.read_text())
        body, digest = doc["body"], doc["sha256"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise DumpError(f"{path} is not a rollout dump ({e}); was it torn or edited?") from None
    if hashlib.sha256(_canonical(body).encode()).hexdigest() != digest:
        raise DumpError(
            f"{path}: the checksum does not match the content (the file was altered or "
            "damaged); dump the step again"
        )
    if body.get("format") != FORMAT or body.get("version") != FORMAT_VERSION:
        raise DumpError(
            f"{path}: format {body.get('format')!r} version {body.get('version')!r}, this "
            f"version reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    return body


def same_metrics(a: Mapping[str, float], b: Mapping[str, float], keys: Sequence[str]) -> bool:
    """Whether `a` and `b` hold bit-identical values for each of `keys` present in both (NaN
    equal to NaN)."""
    for k in keys:
        if k in a and k in b:
            x, y = float(a[k]), float(b[k])
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                return False
    return True
