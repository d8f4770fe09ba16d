"""The rules of the engines and how weights reach them: the fleet, the cores each role runs
on, the prefix-cache salt, the run's two keys, the warm start, the engines' own settings (LoRA
on for a LoRA run), the weight transport and the dtype weights travel in.

Rules (in `RULES` order): `engines`, `placement`, `cache_salt`, `keys`, `warmstart`,
`engine`, `lora`, `transport`, `weight_dtype`.
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets

from router.access import ADMIN_KEY_ENV, API_KEY_ENV
from router.config import router_config_from_args
from slime_async.config.engine_fleet import EngineFleetConfig
from slime_async.config.rules.colocation import TURN_FLAGS, turns
from slime_async.config.rules.draft import Draft, Placement, rule
from slime_async.config.run_paths import derive_warmstart
from slime_async.contracts.adapter import lora_spec
from slime_async.contracts.weights import Payload
from slime_async.engine.config import engine_run_config_from_args
from slime_async.weights.registry import get_weight_transport, resolve_weight_transport

__all__ = [
    "cache_salt",
    "engine",
    "engines",
    "keys",
    "lora",
    "placement",
    "transport",
    "warmstart",
    "weight_dtype",
]


@rule("engines")
def engines(d: Draft) -> None:
    """The rollout engines (backend, count, URLs); records the count and GPUs they resolved."""
    a, f = d.args, d.flags
    d.engines = fleet = EngineFleetConfig.from_args(a)
    if f.unset("num_engines"):
        why = "one per --engine-urls URL" if fleet.urls else "the default"
        if a.rollout_num_gpus is not None:
            why = (
                f"--rollout-num-gpus {a.rollout_num_gpus} / --rollout-num-gpus-per-engine "
                f"{fleet.gpus_per_engine}"
            )
        f.note("num_engines", fleet.num_engines, why)
    if a.rollout_num_gpus is None:
        why = "--num-engines x --rollout-num-gpus-per-engine"
        f.note("rollout_num_gpus", fleet.rollout_num_gpus, why)


_CORE_FLAGS = ("trainer-cores", "rollout-cores")


@rule("placement", fills=("colocate", *TURN_FLAGS))
def placement(d: Draft) -> None:
    """Colocation and the trainer's and engines' cores on the cores this process may use: apart
    (the two halves) unless it may use a single core. On a joined cluster the roles run on
    other nodes: each pins cores of its own node at start-up
    (`slime_async.orchestrator.placement`), so none are derived from this machine. Then the
    turns trainer and engines take (`colocation.turns`: --offload-train, --offload-rollout,
    --engine-sleep-level, the SGLang servers' memory saver)."""
    _placement(d)
    turns(d)


def _placement(d: Draft) -> None:
    a, f, cpus = d.args, d.flags, d.env.cpus
    given = {k: tuple(v) for k in _CORE_FLAGS if (v := getattr(a, k.replace("-", "_"))) is not None}
    if d.env.ray_address is not None:
        if given:
            raise ValueError(
                "--trainer-cores/--rollout-cores name cores of this machine, but on a joined "
                "Ray cluster every role pins cores of its own node (split by the CPUs it "
                "reserves); drop them (or size --actor-num-cpus-per-rank / "
                "--rollout-num-cpus-per-engine)"
            )
        if f.unset("colocate"):
            f.fill("colocate", False, "joined Ray cluster: cores are pinned per node")
        d.placement = Placement(colocate=bool(a.colocate))
        return
    _check_colocate(a, given)
    if f.unset("colocate"):
        if len(cpus) < 2 and given:
            raise ValueError(
                f"--trainer-cores/--rollout-cores need 2 or more CPU cores, but this process may "
                f"use only core {cpus[0]}; drop them (trainer and engines then share it)"
            )
        f.fill("colocate", len(cpus) < 2, f"{len(cpus)} usable CPU core(s): {list(cpus)}")
    d.placement = Placement(colocate=True) if a.colocate else _split_cores(d, given)


def _check_colocate(a: argparse.Namespace, given: dict[str, tuple[int, ...]]) -> None:
    """--colocate shares all cores: not with cores given per role."""
    if a.colocate and given:
        raise ValueError(
            "--colocate shares all cores; do not also pass --trainer-cores/--rollout-cores"
        )


def _split_cores(d: Draft, given: dict[str, tuple[int, ...]]) -> Placement:
    """Trainer and engines apart: the first and second half of the usable cores, or the cores
    given (usable ones, disjoint; under --pipeline-scheduler they may overlap: partial overlap,
    where the scheduler's trainer slots keep the engines there asleep while the trainer trains,
    and the run's member refuses an engine on the trainer's cores that is not on one)."""
    cpus = d.env.cpus
    half = max(1, len(cpus) // 2)
    defaults = {"trainer-cores": (cpus[:half], "first"), "rollout-cores": (cpus[half:], "second")}
    for flag, (cores, which) in defaults.items():
        if flag not in given:
            why = f"{which} half of the usable cores {list(cpus)}"
            d.flags.note(flag.replace("-", "_"), cores, why)
            given[flag] = cores
        elif missing := sorted(set(given[flag]) - set(cpus)):
            raise ValueError(
                f"--{flag} names core(s) {missing} this process may not use (usable: "
                f"{list(cpus)}); pick cores from that set"
            )
    trainer, rollout = given["trainer-cores"], given["rollout-cores"]
    if set(trainer) & set(rollout) and d.args.pipeline_scheduler is None:
        raise ValueError(
            f"--trainer-cores {trainer} and --rollout-cores {rollout} overlap; give disjoint sets "
            "or use --colocate (or, under --pipeline-scheduler, make the slots of the engines "
            "on the trainer's cores its trainer slots: partial overlap)"
        )
    return Placement(colocate=False, trainer_cores=trainer, rollout_cores=rollout)


@rule("cache_salt", fills=("router_cache_salt",))
def cache_salt(d: Draft) -> None:
    """Salt each request's prefix-cache key with the weight version for SGLang engines (they
    would share cached prefixes across versions); the embedded engine keys its cache itself."""
    if not d.flags.unset("router_cache_salt"):
        return
    if d.engines.backend in ("sglang", "external"):
        why = (
            "SGLang engines share cached prefixes across weight versions unless each "
            "request's extra_key changes with the push (docs/weight-sync.md)"
        )
        d.flags.fill("router_cache_salt", True, why)
    else:
        why = "the embedded engine keys its prefix cache by weight version itself"
        d.flags.fill("router_cache_salt", False, why)


@rule("keys")
def keys(d: Draft) -> None:
    """The router's config and the run's two keys, SGLang's `--admin-api-key` and `--api-key`
    on the router and every engine. The admin key is the operator's (`$SLIME_ASYNC_AUTH_TOKEN`
    / `--auth-token-file`, or a deprecated `--router-auth-token`) and stays with the run; the
    data-plane key (`$SLIME_ASYNC_API_KEY` / `--api-key-file`) is what the rollout client,
    plugins and agents get. With an admin key and no data-plane key the run mints one (attached
    engines need theirs given). Joining a cluster puts servers on node IPs, so it needs keys."""
    a, env = d.args, d.env
    flag = a.router_auth_token
    if flag and env.auth_token and flag != env.auth_token:
        raise ValueError(
            f"--router-auth-token differs from the run's admin key (${ADMIN_KEY_ENV} / "
            "--auth-token-file); router and engines use one admin key: drop --router-auth-token"
        )
    admin, api = flag or env.auth_token, env.api_key
    if env.ray_address is not None and not admin:
        raise ValueError(
            f"joining the Ray cluster at {env.ray_address} puts the engines and the router on "
            f"their nodes' IPs, which needs the run's admin key: export {ADMIN_KEY_ENV}=<key> "
            "or pass --auth-token-file PATH (never the key itself on the command line)"
        )
    if api and not admin:
        raise ValueError(
            f"${API_KEY_ENV} (or --api-key-file) without an admin key: the data-plane key would "
            f"also open the control routes; export {ADMIN_KEY_ENV}=<another key> (or pass "
            "--auth-token-file PATH) too"
        )
    if admin and not api and not a.router_open_data_plane:
        if d.engines.backend == "external":
            raise ValueError(
                f"attaching engines (--engine-backend external) with an admin key: give their "
                f"data-plane key too ({API_KEY_ENV}=<key> or --api-key-file PATH; the servers "
                "run with --api-key <it> --admin-api-key <the admin key>)"
            )
        api = secrets.token_urlsafe(32)
        d.flags.note(
            "api_key_file",
            "none: a data-plane key minted for this run",
            "the rollout client, plugins and agents get it; the admin key stays with the run",
        )
    ns = argparse.Namespace(**{**vars(a), "router_auth_token": admin})
    d.router = router_config_from_args(ns, prefix="router-", api_key=api)
    d.api_key, d.admin_api_key = api, admin


@rule("warmstart", fills=("warmstart_steps",))
def warmstart(d: Draft) -> None:
    """Warm start only for a fresh embedded default run (`run_paths.derive_warmstart`)."""
    derive_warmstart(d.flags, embedded=d.embedded, resume=d.trainer.load is not None)


@rule("engine", fills=("engine_dtype",))
def engine(d: Draft) -> None:
    """The embedded engines' settings: the run's rollout seed, one thread each when the roles
    have cores of their own, and `--engine-dtype` from the CPU as rule `bf16` derives `--bf16`:
    bf16 where the CPU multiplies bf16 natively (AMX / AVX512_BF16), fp32 where bf16 would be
    emulated (many times slower than fp32); bf16 for the embedded default run (docs/cpu.md)."""
    f, env = d.flags, d.env
    if f.unset("engine_dtype") and d.engines.backend == "embedded":
        if d.embedded:
            why = (
                "the embedded default run's engines serve bf16 against its fp32 trainer: the "
                "mismatch its CompIS corrects (a tiny model, fast either way)"
            )
            f.fill("engine_dtype", "bf16", why)
        elif env.ray_address is not None:
            why = (
                "the engines run on the cluster's nodes, whose CPUs are not read here (give "
                "--engine-dtype fp32 where they lack AMX/AVX512_BF16)"
            )
            f.fill("engine_dtype", "bf16", why)
        elif env.cpu_bf16:
            f.fill("engine_dtype", "bf16", f"the CPU has {env.cpu_bf16}: native bf16 matmuls")
        else:
            why = "the CPU has no AMX/AVX512_BF16 (bf16 matmuls would be emulated): fp32"
            f.fill("engine_dtype", "fp32", why)
    d.engine = engine_run_config_from_args(
        d.args,
        seed=d.rollout.seed_or(d.args.seed),
        num_threads=None if d.placement.colocate else 1,
    )


@rule("lora")
def lora(d: Draft) -> None:
    """A LoRA run (`--lora-rank` > 0): the run's adapter checked against the model
    (`contracts.adapter.lora_spec`), and the engines, which serve it over the base, start with
    LoRA on, sized to it; refused where the engines cannot take versioned (or, with
    --update-weight-transport distributed, broadcast) adapters."""
    spec = lora_spec(d.trainer, d.env.model)
    if spec is None:
        return
    fleet = d.engines
    if not fleet.needs.versioned_adapters:
        raise ValueError(
            f"--lora-rank pushes each adapter version in place (/load_lora_adapter with "
            f"weight_version), which --engine-backend {fleet.backend} does not do; use the "
            "embedded engines, or --lora-rank 0 (full-weight pushes)"
        )
    transport = d.args.update_weight_transport
    if (
        transport is not None
        and not transport_class(transport, Payload.ADAPTER).shared_filesystem
        and not fleet.needs.distributed_adapters
    ):
        raise ValueError(
            f"--update-weight-transport {transport} with --lora-rank broadcasts the adapter over "
            "the weight group for the engines to stage and activate (/update_weights_from_"
            f"distributed with lora_name), which --engine-backend {fleet.backend} does not do; "
            "use --update-weight-transport disk (or leave it unset)"
        )
    d.engine = dataclasses.replace(
        d.engine,
        enable_lora=True,
        max_lora_rank=spec.rank,
        lora_target_modules=spec.targets,
        max_loaded_loras=1,
    )


def transport_class(name: str, payload: Payload) -> type:
    """The registered transport `name` (or a plugin's `MODULE:NAME`) that moves `payload`;
    ValueError naming the choices when none does."""
    return get_weight_transport(resolve_weight_transport(name), payload)


def _payload(d: Draft) -> Payload:
    return Payload.ADAPTER if d.trainer.lora_rank else Payload.FULL


@rule("transport", fills=("update_weight_transport",))
def transport(d: Draft) -> None:
    """How weights reach the engines: a LoRA run's adapter directory, or a full run's weights
    from disk (servers the run does not own) or over the weight group (no shared filesystem)."""
    f = d.flags
    if not f.unset("update_weight_transport"):  # given: it must move this run's payload
        transport_class(d.args.update_weight_transport, _payload(d))
        return
    if d.trainer.lora_rank:
        why = "LoRA: each push is the adapter's PEFT directory, loaded by name (docs/lora.md)"
        f.fill("update_weight_transport", "disk", why)
    elif not d.engines.needs.owns_processes:
        why = (
            "--engine-backend external: servers the run does not own come back on their own "
            "weights, and the router replays the newest disk load on them before re-admission"
        )
        f.fill("update_weight_transport", "disk", why)
    else:
        why = "no shared filesystem needed (docs/weight-sync.md)"
        f.fill("update_weight_transport", "distributed", why)


@rule("weight_dtype", fills=("update_weight_dtype",))
def weight_dtype(d: Draft) -> None:
    """The dtype weights travel in: the engines' when known to be bf16 (half the bytes of
    fp32; the engine would round to bf16 the same way), the trainer's otherwise."""
    f, t = d.flags, d.trainer
    if not f.unset("update_weight_dtype"):
        return
    name = d.args.update_weight_transport
    shared = name is not None and transport_class(name, _payload(d)).shared_filesystem
    role_reads_disk = shared and t.behavior_forward == "role"
    if t.bf16:
        f.fill("update_weight_dtype", "bfloat16", "the trainer's parameters are bf16")
    elif d.engines.backend == "embedded" and d.engine.dtype == "bf16" and not role_reads_disk:
        f.fill("update_weight_dtype", "bfloat16", "the engines serve bf16 (--engine-dtype bf16)")
    else:
        if role_reads_disk:
            why = "the forward-only role reads the disk exports as the trainer's weights"
        elif d.engines.backend == "embedded":
            why = "the trainer and the engines compute in fp32"
        else:
            why = "the trainer's dtype (the engines' is not known here)"
        f.fill("update_weight_dtype", "float32", why)
