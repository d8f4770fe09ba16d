"""The turns trainer and engines take (slime's `--colocate`, `--offload`, `--offload-train`,
`--offload-rollout`), derived by the `placement` rule after the cores.

Owns `turns` and `TURN_FLAGS`. slime's semantics: `--offload` is `--offload-train` and
`--offload-rollout` together, and a given `--colocate` sets both (a `--colocate` derived from a
single usable core shares the cores only). `--offload-rollout` releases the engines' memory during
each train step at `--engine-sleep-level` (2, weights and KV cache, unless given), and starts SGLang
servers with their memory saver (`--engine-sleep`); `--offload-train` offloads the trainer while
the engines generate. A flag the user gave is never changed: a contradiction is refused naming
both flags. Imports only config modules.
"""

from __future__ import annotations

import dataclasses

from slime_async.config.rules.draft import Draft

__all__ = ["TURN_FLAGS", "turns"]

TURN_FLAGS = ("offload_train", "offload_rollout", "engine_sleep_level", "engine_sleep")
"""The flags `turns` may fill."""


def _why_on(d: Draft) -> str | None:
    """Why the offloads are on by default (None: they are off unless given)."""
    if d.args.offload:
        return "--offload (slime: --offload-train and --offload-rollout together)"
    if d.given.get("colocate"):
        return "--colocate (slime's time-sharing: trainer and engines take turns)"
    return None


def _offloads(d: Draft) -> None:
    """--offload-train and --offload-rollout from --offload / --colocate."""
    a, f = d.args, d.flags
    why = _why_on(d)
    for dest in ("offload_train", "offload_rollout"):
        flag = "--" + dest.replace("_", "-")
        if a.offload and getattr(a, dest) is False:
            raise ValueError(
                f"--offload means --offload-train and --offload-rollout (slime's), but "
                f"--no-{flag[2:]} was given too; drop one of them"
            )
        if f.unset(dest):
            f.fill(dest, why is not None, why or "neither --colocate nor --offload given")
    if a.offload_train and d.trainer.lora_rank > 0:
        raise ValueError(
            "--offload-train (on with --colocate/--offload) with --lora-rank: adapter pushes "
            "read the live trainer, which is offloaded while the engines generate; give "
            "--no-offload-train (the engines still release their memory) or drop --lora-rank"
        )


def _sleep_level(d: Draft) -> None:
    """--engine-sleep-level from --offload-rollout (2: SGLang's weights and KV cache)."""
    a, f = d.args, d.flags
    level = a.engine_sleep_level
    if a.offload_rollout and level == 0:
        raise ValueError(
            "--offload-rollout (on with --colocate/--offload) releases the engines' memory "
            "during each train step, but --engine-sleep-level 0 keeps it; give "
            "--engine-sleep-level 1 (KV cache) or 2 (also the weights), or --no-offload-rollout"
        )
    if a.offload_rollout is False and level:
        raise ValueError(
            f"--no-offload-rollout keeps the engines' memory, but --engine-sleep-level {level} "
            "releases it during each train step; drop one of them"
        )
    if f.unset("engine_sleep_level"):
        if a.offload_rollout:
            why = "--offload-rollout: the engines release their weights and KV cache (slime's)"
            f.fill("engine_sleep_level", 2, why)
        else:
            f.fill("engine_sleep_level", 0, "no --offload-rollout: engines generate throughout")


def _memory_saver(d: Draft) -> None:
    """SGLang servers that sleep must start with --enable-memory-saver (`--engine-sleep`)."""
    a, f = d.args, d.flags
    if d.engines.backend != "sglang" or not a.engine_sleep_level:
        if f.unset("engine_sleep"):
            f.fill("engine_sleep", False, "no SGLang server sleeps in this run")
        return
    if a.engine_sleep is False:
        raise ValueError(
            f"--engine-sleep-level {a.engine_sleep_level} releases the SGLang servers' memory "
            "during each train step, which SGLang frees only when started with "
            "--enable-memory-saver; drop --no-engine-sleep (or --engine-sleep-level / "
            "--colocate)"
        )
    if f.unset("engine_sleep"):
        why = f"--engine-sleep-level {a.engine_sleep_level}: SGLang's --enable-memory-saver"
        f.fill("engine_sleep", True, why)
    d.engines = dataclasses.replace(d.engines, engine_sleep=True)


def turns(d: Draft) -> None:
    """--offload-train, --offload-rollout, --engine-sleep-level and --engine-sleep (see the
    module docstring); a trainer on GPUs keeps its memory (its offload is built for CPU
    memory only): refused when given, off with the reason when derived."""
    _offloads(d)
    if d.args.offload_train and d.env.gpu_memory_bytes:
        if d.given.get("offload_train") or d.args.offload:
            raise ValueError(
                "--offload-train (--offload): the trainer's offload is built for CPU memory only, and this "
                "trainer runs on GPUs; drop it (the engines still release theirs with "
                "--offload-rollout)"
            )
        d.flags.forget("offload_train")
        d.flags.fill("offload_train", False, "the trainer runs on GPUs: offload is CPU-only")
    _sleep_level(d)
    _memory_saver(d)
