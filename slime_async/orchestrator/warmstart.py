"""Warm start: short supervised pre-training on the task family, cached in the run directory.

Owns: `warm_start` (train or reuse), `is_cached`, `sample_responses` / `measure_pass_rates`
(temperature-1 sampling with the HF model, used to check that RL starts from *partial* accuracy). The model is
the HF causal LM built from a `ModelSpec` (plain torch, fp32, CPU), trained on prompts of every
level equally often (so hard levels pass now and then and give RL a signal), with the loss on
the response tokens only. Training stops as soon as the
sampled pass rate on a small probe set reaches ``target_pass_rate`` (or at ``max_steps``), so RL
starts neither at zero reward nor saturated, whatever the spec. The result is an HF
``save_pretrained`` directory ``RUN_DIR/warmstart`` holding ``warmstart.json``, a marker with the
hash of (spec, task config, warm-start config): a changed config re-trains instead of reusing.
The directory is written atomically (temp dir + rename). Imports the model spec and the task
family only; never imports the trainer, engine or controller.

Run it alone to measure: ``python -m slime_async.orchestrator.warmstart --run-dir /tmp/ws``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from slime_async.contracts.model import TINY_MOE, ModelSpec
from slime_async.rollout.data.rewards import exact_match
from slime_async.rollout.data.tasks import (
    EOS,
    PAD,
    TaskFamily,
    TaskFamilyConfig,
    TaskPrompt,
    level_probs,
    task_hf_config,
)

MARKER = "warmstart.json"
"""Name of the marker file inside the cached model directory."""
_FORMAT = 1
_SFT_INDEX_OFFSET = 1 << 40  # SFT prompts come from a far-away stretch of the train stream


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WarmStartConfig:
    """Supervised warm start of the embedded model."""

    max_steps: int = 400
    """Upper bound on optimizer steps."""
    batch_size: int = 64
    """Sequences per step."""
    level_mix: Literal["uniform", "train"] = "uniform"
    """SFT level mix: "uniform" (every level equally often, so hard levels pass sometimes) or
    "train" (the RL distribution, where hard prompts are rare and end near 0% pass rate)."""
    lr: float = 2e-3
    """AdamW learning rate (constant after warmup)."""
    warmup_steps: int = 10
    """Linear learning-rate warmup."""
    seed: int = 0
    """Seed for initialization, batches and sampling."""
    target_pass_rate: float | None = 0.35
    """Stop once the sampled (T=1) pass rate on the probe set reaches this; None = run max_steps."""
    check_every: int = 20
    """Steps between probe measurements."""
    probe_per_level: int = 16
    """Probe prompts per level (held-out; weighted by the training level distribution)."""
    report_per_level: int = 32
    """Held-out prompts per level for the final pass-rate report."""
    report_samples: int = 4
    """Samples per report prompt (level 0 has few distinct held-out prompts)."""
    num_threads: int | None = 1
    """torch threads while training (None = leave as is); not part of the cache hash. One thread
    is the fastest for this tiny model: on a busy 2-core machine 2 threads ran 26x slower."""

    def __post_init__(self) -> None:
        if self.max_steps < 0 or self.batch_size < 1 or self.check_every < 1:
            raise ValueError("max_steps must be >= 0, batch_size and check_every >= 1")
        if self.level_mix not in ("uniform", "train"):
            raise ValueError(f"level_mix must be 'uniform' or 'train', got {self.level_mix!r}")
        if self.target_pass_rate is not None and not 0.0 < self.target_pass_rate < 1.0:
            raise ValueError(f"target_pass_rate must be in (0, 1), got {self.target_pass_rate}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WarmStartResult:
    """Where the warm-started model lives and how good it is."""

    path: Path
    """HF model directory (``AutoModelForCausalLM.from_pretrained(path)`` loads it)."""
    reused: bool
    """True when a matching cached model was found and nothing was trained."""
    steps: int
    """Optimizer steps that produced the model."""
    pass_rates: dict[int, float]
    """Sampled (T=1) exact-match pass rate per level on held-out prompts."""
    pass_rate: float
    """Overall pass rate, weighted by the training level distribution."""
    seconds: float
    """Training + measurement time when trained (0 when reused)."""


def cache_hash(spec: ModelSpec, task: TaskFamilyConfig, config: WarmStartConfig) -> str:
    """Identity of a warm start: changes whenever anything that shapes the model changes."""
    ws = dataclasses.asdict(config)
    ws.pop("num_threads")
    blob = json.dumps(
        {"format": _FORMAT, "spec": spec.to_dict(), "task": task.to_dict(), "warmstart": ws},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def build_model(spec: ModelSpec, *, seed: int) -> Any:
    """A freshly initialized fp32 HF causal LM for ``spec`` with the task special tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(task_hf_config(spec), dtype=torch.float32)


# ---------------------------------------------------------------------------- sampling
@torch.no_grad()
def sample_responses(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    eos_id: int = EOS,
) -> list[list[int]]:
    """Sample one response per prompt (pure softmax sampling, no top-k/top-p).

    Prompts of equal length are batched together with a KV cache. Each response ends at its
    first EOS (included) or after ``max_new_tokens``.
    """
    model.eval()
    out: list[list[int] | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        x = torch.tensor([list(prompts[i]) for i in idx], dtype=torch.long)
        res = model(input_ids=x, use_cache=True)
        past, logits = res.past_key_values, res.logits[:, -1]
        toks: list[torch.Tensor] = []
        done = torch.zeros(len(idx), dtype=torch.bool)
        for _ in range(max_new_tokens):
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            toks.append(nxt)
            done |= nxt[:, 0] == eos_id
            if bool(done.all()):
                break
            res = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[:, -1]
        seqs = torch.cat(toks, dim=1).tolist()
        for row, i in zip(seqs, idx):
            out[i] = row[: row.index(eos_id) + 1] if eos_id in row else row
    return [o for o in out if o is not None]


def measure_pass_rates(
    model: Any, prompts: Sequence[TaskPrompt], *, seed: int = 0, temperature: float = 1.0
) -> dict[int, float]:
    """Sampled exact-match pass rate per level over ``prompts``."""
    g = torch.Generator().manual_seed(seed)
    max_new = max(p.expected_len for p in prompts) + 2
    resp = sample_responses(
        model,
        [p.prompt_ids for p in prompts],
        max_new_tokens=max_new,
        temperature=temperature,
        generator=g,
    )
    hits: dict[int, list[float]] = {}
    for p, r in zip(prompts, resp):
        hits.setdefault(p.level, []).append(float(exact_match(r, p.label_ids)))
    return {lv: sum(v) / len(v) for lv, v in sorted(hits.items())}


def weighted_pass_rate(rates: dict[int, float], task: TaskFamilyConfig) -> float:
    """Overall pass rate under the training level distribution."""
    probs = level_probs(task)
    return sum(probs[lv] * r for lv, r in rates.items()) / sum(probs[lv] for lv in rates)


# ---------------------------------------------------------------------------- training
def _batch(prompts: Sequence[TaskPrompt]) -> dict[str, torch.Tensor]:
    seqs = [(*p.prompt_ids, *p.response_ids) for p in prompts]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        labels[i, len(p.prompt_ids) : len(s)] = torch.tensor(p.response_ids)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _sft_prompts(fam: TaskFamily, rng: random.Random, config: WarmStartConfig) -> list[TaskPrompt]:
    base = _SFT_INDEX_OFFSET + rng.randrange(1 << 30)
    if config.level_mix == "train":
        return fam.train_prompts(base, config.batch_size)
    levels = fam.config.num_levels
    return [fam.train_prompt(base + i, level=i % levels) for i in range(config.batch_size)]


def _train(
    spec: ModelSpec,
    task: TaskFamilyConfig,
    config: WarmStartConfig,
    say: Callable[[str], None],
) -> tuple[Any, int]:
    fam = TaskFamily(task)
    model = build_model(spec, seed=config.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    probe = fam.eval_set(config.probe_per_level)
    rng = random.Random(f"warmstart/{config.seed}")
    start, step = time.monotonic(), 0
    while step < config.max_steps:
        if config.target_pass_rate is not None and step % config.check_every == 0 and step > 0:
            rate = weighted_pass_rate(measure_pass_rates(model, probe, seed=step), task)
            elapsed = time.monotonic() - start
            say(f"warm start step {step}: probe pass rate {rate:.2f} ({elapsed:.0f}s)")
            if rate >= config.target_pass_rate:
                break
        model.train()
        loss = model(**_batch(_sft_prompts(fam, rng, config))).loss
        for group in opt.param_groups:
            group["lr"] = config.lr * min(1.0, (step + 1) / max(1, config.warmup_steps))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"warm start diverged at step {step} (loss {loss.item()})")
    return model, step


def _cached(path: Path, digest: str) -> dict[str, Any] | None:
    marker = path / MARKER
    if not (marker.is_file() and (path / "config.json").is_file()):
        return None
    if not any(path.glob("*.safetensors")):
        return None
    try:
        meta = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return meta if meta.get("hash") == digest else None


def is_cached(
    run_dir: str | Path,
    *,
    spec: ModelSpec = TINY_MOE,
    task: TaskFamilyConfig | None = None,
    config: WarmStartConfig | None = None,
) -> bool:
    """Whether `warm_start` with these arguments would reuse ``run_dir/warmstart``."""
    digest = cache_hash(spec, task or TaskFamilyConfig(), config or WarmStartConfig())
    return _cached(Path(run_dir) / "warmstart", digest) is not None


def warm_start(
    run_dir: str | Path,
    *,
    spec: ModelSpec = TINY_MOE,
    task: TaskFamilyConfig | None = None,
    config: WarmStartConfig | None = None,
    say: Callable[[str], None] = print,
) -> WarmStartResult:
    """Return the warm-started model directory ``run_dir/warmstart``, training it if needed."""
    task = task or TaskFamilyConfig()
    config = config or WarmStartConfig()
    run_dir = Path(run_dir)
    final = run_dir / "warmstart"
    digest = cache_hash(spec, task, config)
    meta = _cached(final, digest)
    if meta is not None:
        rates = {int(k): float(v) for k, v in meta["pass_rates"].items()}
        say(f"warm start: reusing {final} (pass rate {meta['pass_rate']:.2f})")
        return WarmStartResult(
            path=final,
            reused=True,
            steps=int(meta["steps"]),
            pass_rates=rates,
            pass_rate=float(meta["pass_rate"]),
            seconds=0.0,
        )
    if final.exists():
        say(f"warm start: {final} was built from another config; re-training")
    threads = torch.get_num_threads()
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    try:
        t0 = time.monotonic()
        model, steps = _train(spec, task, config, say)
        report = TaskFamily(task).eval_set(config.report_per_level) * config.report_samples
        rates = measure_pass_rates(model, report, seed=config.seed + 1)
        seconds = time.monotonic() - t0
    finally:
        torch.set_num_threads(threads)
    overall = weighted_pass_rate(rates, task)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".warmstart.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    model.save_pretrained(tmp)
    meta = {
        "hash": digest,
        "steps": steps,
        "pass_rates": {str(k): v for k, v in rates.items()},
        "pass_rate": overall,
        "seconds": seconds,
        "spec": spec.to_dict(),
        "task": task.to_dict(),
        "warmstart": dataclasses.asdict(config),
    }
    (tmp / MARKER).write_text(json.dumps(meta, indent=2, sort_keys=True))
    old = None
    if final.exists():
        old = run_dir / f".warmstart.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    say(
        f"warm start: {steps} steps in {seconds:.0f}s, pass rate {overall:.2f} "
        f"(per level {', '.join(f'{lv}: {r:.2f}' for lv, r in rates.items())})"
    )
    return WarmStartResult(
        path=final,
        reused=False,
        steps=steps,
        pass_rates=rates,
        pass_rate=overall,
        seconds=seconds,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Train (or reuse) the default warm start and print its pass rates."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, help="directory that holds the cached model")
    ap.add_argument("--max-steps", type=int, default=WarmStartConfig().max_steps, help="step cap")
    ap.add_argument("--target-pass-rate", type=float, default=0.35, help="stop at this rate")
    ap.add_argument("--threads", type=int, default=1, help="torch threads while training")
    args = ap.parse_args(argv)
    cfg = WarmStartConfig(
        max_steps=args.max_steps, target_pass_rate=args.target_pass_rate, num_threads=args.threads
    )
    res = warm_start(args.run_dir, config=cfg)
    print(json.dumps({**dataclasses.asdict(res), "path": str(res.path)}, indent=2))


if __name__ == "__main__":
    main()
