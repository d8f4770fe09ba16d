"""Loading prompt/label datasets from jsonl or parquet, with bad rows skipped and counted.

Owns: `DatasetConfig`, `DataRow`, `load_dataset`. A row needs a non-empty prompt (a string, or a
list of chat messages ``{"role", "content"}``) and, unless ``require_label=False``, a label.
Malformed rows (invalid JSON, not an object, missing or empty prompt, missing label, metadata
that is not an object) are skipped and counted by reason; with ``strict=True`` the first one
raises `DatasetError` naming the file and line (jsonl) or row (parquet). With a tokenizer,
prompts go through its chat template (``add_generation_prompt=True``) and are tokenized; rows
with images (``image_key``) get their placeholders (`rollout.data.images`), an unreadable image
making a malformed row. Never imports the trainer, engine or controller; pyarrow and
transformers are imported lazily.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A dataset file or row that cannot be used (message names the file and line)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DatasetConfig:
    """How to read a prompt dataset."""

    path: str
    """A .jsonl / .json-lines or .parquet file."""
    prompt_key: str = "prompt"
    """Field holding the prompt (a string or a list of chat messages)."""
    label_key: str = "label"
    """Field holding the label handed to the reward function."""
    id_key: str | None = None
    """Optional field with a stable row id (default: a hash of prompt and label)."""
    metadata_keys: tuple[str, ...] = ()
    """Extra fields copied into `DataRow.metadata`."""
    metadata_key: str | None = None
    """slime's `--metadata-key`: the field holding the row's metadata, a JSON object (or its
    text), merged into `DataRow.metadata`; a row without it has none."""
    require_label: bool = True
    """Treat rows without a label as malformed."""
    strict: bool = False
    """Raise on the first malformed row instead of skipping it."""
    apply_chat_template: bool | None = None
    """With a tokenizer: True = always, False = never, None = when the tokenizer has one."""
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the chat template (slime's --apply-chat-template-kwargs, e.g.
    `{"enable_thinking": False}`)."""
    system_prompt: str | None = None
    """Optional system message prepended to string prompts before the chat template."""
    flag: str = "--prompt-data"
    """The flag that named the file (said when it does not exist)."""
    image_key: str | None = None
    """Field holding each row's images (`--multimodal-keys '{"image": FIELD}'`): a path,
    base64 or a data URI, or a list of them (`rollout.data.images`)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DataRow:
    """One usable dataset row."""

    key: str
    """Stable id (from `id_key`, else a content hash): the same row always has the same key."""
    prompt: str | list[dict[str, Any]]
    """The prompt as read."""
    label: Any
    """The label as read (None only when `require_label=False`)."""
    line: int
    """1-based line (jsonl) or row (parquet) in the file."""
    prompt_text: str | None = None
    """Prompt after the chat template (None without a tokenizer)."""
    prompt_ids: tuple[int, ...] | None = None
    """Tokenized prompt (None without a tokenizer)."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Copied `metadata_keys`."""
    images: tuple[str, ...] = ()
    """The row's image references (`image_key`); its prompt ids hold their placeholders."""
    image_tokens: int = 0
    """How many of its prompt ids are image placeholders (the router counts them as work)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoadedDataset:
    """Rows that loaded, and what was skipped."""

    rows: list[DataRow]
    """Usable rows, in file order."""
    skipped: dict[str, int]
    """Skipped-row count by reason."""
    path: str
    """File that was read."""

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def metrics(self) -> dict[str, float]:
        """``data/rows`` and ``data/skipped`` for the metric log."""
        return {"data/rows": float(len(self.rows)), "data/skipped": float(self.num_skipped)}


# ---------------------------------------------------------------------------- readers
def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """Yield (line, record or None, problem or None) for every line."""
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                yield lineno, None, "empty line"
                continue
            try:
                yield lineno, json.loads(raw), None
            except json.JSONDecodeError as e:
                yield lineno, None, f"invalid JSON ({e.msg} at column {e.colno})"


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"reading {path} needs pyarrow: pip install pyarrow (or convert the file to jsonl)"
        ) from e
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        for rec in batch.to_pylist():
            row += 1
            yield row, rec, None


def _reader(path: Path) -> tuple[Iterator[tuple[int, Any, str | None]], str]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson") or path.name.lower().endswith(".json-lines"):
        return _iter_jsonl(path), "line"
    if suffix in (".parquet", ".pq"):
        return _iter_parquet(path), "row"
    raise DatasetError(f"{path}: unsupported dataset format {suffix!r}; use .jsonl or .parquet")


def count_rows(path: str | Path) -> int:
    """The rows of a dataset file without reading them: the non-blank lines of a JSONL file,
    the row count a parquet file's footer records (what slime's `--num-epoch` counts: rows
    that fail validation count too). Raises `DatasetError` for another format."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(p).metadata.num_rows)
    if suffix in (".jsonl", ".ndjson") or p.name.lower().endswith(".json-lines"):
        with p.open("rb") as f:
            return sum(1 for line in f if line.strip())
    raise DatasetError(f"{p}: unsupported dataset format {suffix!r}; use .jsonl or .parquet")


# ---------------------------------------------------------------------------- validation
def _is_messages(x: Any) -> bool:
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in x)
    )


def _row_problem(rec: Any, cfg: DatasetConfig) -> tuple[str, str] | None:
    """(reason, detail) when ``rec`` is unusable, else None."""
    if not isinstance(rec, dict):
        return "not an object", f"expected a JSON object, got {type(rec).__name__}"
    if cfg.prompt_key not in rec:
        return "missing prompt", (
            f"no {cfg.prompt_key!r} field (fields: {sorted(rec)[:8]}); set the prompt key to "
            f"the field holding the prompt"
        )
    prompt = rec[cfg.prompt_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            return "empty prompt", f"{cfg.prompt_key!r} is empty"
    elif not _is_messages(prompt):
        return "bad prompt", (
            f"{cfg.prompt_key!r} must be a non-empty string or a list of "
            f"{{'role', 'content'}} messages, got {type(prompt).__name__}"
        )
    if cfg.require_label:
        label = rec.get(cfg.label_key)
        if label is None or (isinstance(label, str) and not label.strip()):
            return "missing label", f"no or empty {cfg.label_key!r} field; set the label key"
    if cfg.metadata_key is not None and _row_metadata(rec, cfg.metadata_key) is None:
        return "bad metadata", (
            f"{cfg.metadata_key!r} must be a JSON object (or its text), got "
            f"{type(rec[cfg.metadata_key]).__name__}"
        )
    return None


def _row_metadata(rec: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The object under `key` ({} when absent or null); None when it is not an object."""
    value = rec.get(key)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if value is None:
        return {}
    return value if isinstance(value, dict) else None


def _row_key(rec: dict[str, Any], cfg: DatasetConfig) -> str:
    if cfg.id_key is not None and rec.get(cfg.id_key) is not None:
        return str(rec[cfg.id_key])
    parts = [rec[cfg.prompt_key], rec.get(cfg.label_key)]
    if cfg.image_key is not None:  # the same question about another image is another row
        parts.append(rec.get(cfg.image_key))
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _apply_template(prompt: Any, tokenizer: Any, cfg: DatasetConfig) -> tuple[str, list[int]]:
    use = cfg.apply_chat_template
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use is None:
        use = has_template
    if use and not has_template:
        raise DatasetError(
            "apply_chat_template=True but the tokenizer has no chat template; "
            "pass apply_chat_template=None/False or use a chat model's tokenizer"
        )
    if use:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if cfg.system_prompt and isinstance(prompt, str):
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **cfg.chat_template_kwargs
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        if isinstance(prompt, list):
            text = "\n".join(str(m["content"]) for m in prompt)
        else:
            text = prompt if not cfg.system_prompt else f"{cfg.system_prompt}\n{prompt}"
        ids = tokenizer(text)["input_ids"]
    return text, list(ids)


def _tokenized(
    rec: dict[str, Any], config: DatasetConfig, tokenizer: Any, vision: Any
) -> tuple[str | None, list[int] | None, tuple[str, ...]]:
    """(prompt text, ids, image references) of a row; images get their placeholders
    (`images.with_placeholders`, `images.expand`). ValueError: an unusable image."""
    from slime_async.rollout.data import images as im

    prompt = rec[config.prompt_key]
    refs = im.row_images(rec, config.image_key) if config.image_key else ()
    if refs and vision is None:
        raise DatasetError(
            f"rows have images ({config.image_key!r}) but the model is not a vision-language "
            "model; give a Qwen2.5-VL or Qwen3-VL --hf-checkpoint or drop --multimodal-keys"
        )
    if tokenizer is None:
        return None, None, refs
    if refs:
        prompt = im.with_placeholders(prompt, len(refs), vision.placeholder)
    text, ids = _apply_template(prompt, tokenizer, config)
    return text, (im.expand(ids, refs, vision) if refs else ids), refs


def _image_tokens(ids: list[int] | None, vision: Any) -> int:
    return 0 if ids is None else sum(t == vision.vision.image_token_id for t in ids)


def load_dataset(
    config: DatasetConfig, *, tokenizer: Any = None, vision: Any = None
) -> LoadedDataset:
    """Read every usable row of ``config.path`` (see the module docstring for the rules);
    `vision` (`images.VisionData`) with `config.image_key`."""
    path = Path(config.path)
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist (check {config.flag})")
    records, unit = _reader(path)
    rows: list[DataRow] = []
    skipped: collections.Counter[str] = collections.Counter()
    for lineno, rec, problem in records:
        detail = problem
        reason = "empty line" if problem == "empty line" else "invalid JSON"
        if problem is None:
            found = _row_problem(rec, config)
            if found is not None:
                reason, detail = found
        if detail is None:
            try:
                text, ids, refs = _tokenized(rec, config, tokenizer, vision)
            except DatasetError:
                raise
            except (ValueError, OSError) as e:
                reason, detail = "bad image", str(e)
        if detail is not None:
            if config.strict:
                where = f"{path}:{lineno}" if unit == "line" else f"{path} (row {lineno})"
                raise DatasetError(
                    f"{where}: {detail}; fix the row, or load without "
                    f"strict mode (--strict-data) to skip bad rows with a count"
                )
            skipped[reason] += 1
            continue
        prompt = rec[config.prompt_key]
        rows.append(
            DataRow(
                key=_row_key(rec, config),
                prompt=prompt,
                label=rec.get(config.label_key),
                line=lineno,
                prompt_text=text,
                prompt_ids=tuple(ids) if ids is not None else None,
                metadata={
                    **{k: rec.get(k) for k in config.metadata_keys},
                    **(_row_metadata(rec, config.metadata_key) if config.metadata_key else {}),
                },
                images=refs,
                image_tokens=_image_tokens(ids, vision) if refs else 0,
            )
        )
    if skipped:
        log.warning(
            "%s: loaded %d rows, skipped %d (%s)",
            path,
            len(rows),
            sum(skipped.values()),
            ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items())),
        )
    if not rows:
        raise DatasetError(
            f"{path}: no usable rows ({sum(skipped.values())} skipped: {dict(skipped)}); check "
            f"the prompt key {config.prompt_key!r} and label key {config.label_key!r}"
        )
    return LoadedDataset(rows=rows, skipped=dict(skipped), path=str(path))
