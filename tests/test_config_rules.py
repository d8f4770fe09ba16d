"""The named validation rules (`slime_async.config.rules`), each alone on a small hand-built
draft: the value it derives and why, or its refusal; their order; and the memory fallback,
which re-runs only the rules `--behavior-forward` feeds and gives what validating with
`--behavior-forward trainer` gives."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

import slime_async.config.rules as rules_pkg
from data_worker.config import DataWorkerConfig
from loss import loss_settings_from_args
from slime_async.config import Environment, build_parser, validate
from slime_async.config.engine_fleet import EngineFleetConfig
from slime_async.config.memory_plan import MEMORY_FRACTION
from slime_async.config.rules import RULES, Draft, data, memory, serving, training
from slime_async.config.rules.draft import Placement
from slime_async.config.run_config import Derived
from slime_async.contracts.adapter import ATTENTION_MODULES, NO_EXPERT_ADAPTERS
from slime_async.contracts.model import SMOLLM2_135M, TINY_MOE
from slime_async.engine.config import engine_run_config_from_args
from slime_async.rollout.config import rollout_config_from_args
from slime_async.trainer.checkpoint import LoadFacts
from slime_async.trainer.config import REAL_MODEL_LR, TrainerConfig

pytestmark = pytest.mark.timeout(120)

ENV = Environment(model=TINY_MOE, cpus=(0, 1, 2, 3))
USER = ("--hf-checkpoint", "/m", "--prompt-data", "t.jsonl")


def draft(*argv: str, env: Environment = ENV, **facts: object) -> Draft:
    """A draft of `argv` with the given facts set by hand (the rules before are not run)."""
    d = Draft.start(build_parser().parse_args(list(argv)), env)
    for name, value in facts.items():
        setattr(d, name, value)
    return d


def why(d: Draft, flag: str) -> str:
    return d.flags.derived[flag].why


def dw(**kw: object) -> DataWorkerConfig:
    return DataWorkerConfig(**{"max_staleness": 2, "fifo_window": 64, "groups_per_step": 32, **kw})


# ------------------------------------------------------------------------------- the order
ORDER = [
    "gguf",
    "embedded",
    "run_flags",
    "rollout",
    "eval",
    "steps",
    "inflight",
    "data_worker",
    "schedule",
    "off_policy_drop",
    "loss",
    "debug_modes",
    "lr",
    "run_kind",
    "behavior_forward",
    "snapshots",
    "bf16",
    "fused_kernels",
    "save_hf",
    "trainer",
    "script_flags",
    "resume",
    "engines",
    "placement",
    "cache_salt",
    "keys",
    "warmstart",
    "engine",
    "lora",
    "transport",
    "weight_dtype",
    "run_config",
    "batch_shape",
    "memory",
]


def test_the_rules_run_in_the_documented_order():
    assert [r.name for r in RULES] == ORDER
    assert all(r.doc.strip() for r in RULES)
    table = re.findall(r"^\| (\d+) \| `(\w+)` \|", rules_pkg.__doc__ or "", re.M)
    assert [(int(i), n) for i, n in table] == list(enumerate(ORDER, 1))
    assert [r.name for r in memory.REFIT] == [
        n for n in ORDER if n in ("snapshots", "trainer", "resume", "weight_dtype", "run_config")
    ]


def test_a_rule_before_the_facts_it_reads_fails_at_once():
    with pytest.raises(AttributeError, match="rollout"):
        data.steps(draft())  # `rollout` has not run: no default is read instead


def test_the_rules_in_order_are_validate():
    args = build_parser().parse_args([])
    d = Draft.start(args, ENV)
    for r in RULES:
        r(d)
    assert d.config == validate(args, ENV)
    assert list(d.config.derived) == list(validate(args, ENV).derived)
    assert args.num_steps is None  # the caller's namespace stays as given


# ------------------------------------------------------------------------- data.py
def test_gguf_reads_the_converted_directory():
    env = dataclasses.replace(ENV, converted_checkpoint="/run/hf_from_gguf/m")
    d = draft("--hf-checkpoint", "m.gguf", env=env)
    data.gguf(d)
    assert d.args.hf_checkpoint == "/run/hf_from_gguf/m"
    assert why(d, "--hf-checkpoint") == "converted from the GGUF file m.gguf"
    plain = draft("--hf-checkpoint", "/m")
    data.gguf(plain)
    assert plain.args.hf_checkpoint == "/m" and not plain.flags.derived


@pytest.mark.parametrize(
    "argv, embedded",
    [((), True), (("--prompt-data", "t.jsonl"), False), (("--hf-checkpoint", "/m"), False)],
)
def test_embedded_is_the_run_without_a_model_or_data(argv, embedded):
    d = draft(*argv)
    data.embedded(d)
    assert d.embedded is embedded


def test_run_flags_refuses_contradictions_together():
    with pytest.raises(ValueError, match="either --num-steps or --num-rollout"):
        data.run_flags(draft("--num-steps", "3", "--num-rollout", "2"))
    both = ("--num-steps", "3", "--num-rollout", "2", "--router-worker-urls", "http://a:1")
    with pytest.raises(ValueError, match=r"invalid flags:(.|\n)*--router-worker-urls"):
        data.run_flags(draft(*both))


def test_rollout_records_the_global_batch():
    d = draft("--rollout-batch-size", "4", "--n-samples-per-prompt", "2")
    data.rollout(d)
    assert d.flags.derived["--global-batch-size"].value == 8
    assert d.rollout.global_batch_size == 8


def test_eval_records_the_cadence_and_what_eval_inherits_or_that_there_is_no_eval_set():
    d = draft()
    d.rollout = rollout_config_from_args(d.args)
    data.eval_settings(d)
    assert d.flags.derived["--eval-interval"].value == d.rollout.eval_interval > 0
    assert why(d, "--eval-temperature") == "--rollout-temperature, as training"
    none = draft("--prompt-data", "t.jsonl")
    none.rollout = rollout_config_from_args(none.args)
    data.eval_settings(none)
    assert none.flags.derived["--eval-interval"].value == 0
    assert why(none, "--eval-interval").startswith("no eval set: a --prompt-data file has no")
    assert list(none.flags.derived) == ["--eval-interval"]  # nothing inherited without eval


def test_steps_from_the_rollouts_unless_given():
    d = draft("--num-rollout", "3", "--num-steps-per-rollout", "2", "--rollout-batch-size", "4")
    d.rollout = rollout_config_from_args(d.args)
    data.steps(d)
    assert d.args.num_steps == 6
    assert why(d, "--num-steps") == "--num-rollout 3 x --num-steps-per-rollout 2"
    given = draft("--num-steps", "5")
    given.rollout = rollout_config_from_args(given.args)
    data.steps(given)
    assert given.args.num_steps == 5 and not given.flags.derived


def test_inflight_from_the_per_server_concurrency():
    d = draft("--sglang-server-concurrency", "4", "--num-engines", "2")
    data.inflight(d)
    assert d.args.max_inflight == 8
    assert why(d, "--max-inflight") == "--sglang-server-concurrency 4 x 2 engines"
    with pytest.raises(ValueError, match="--max-inflight 5 contradicts"):
        data.inflight(
            draft("--sglang-server-concurrency", "4", "--num-engines", "2", "--max-inflight", "5")
        )
    same = draft("--sglang-server-concurrency", "4", "--num-engines", "2", "--max-inflight", "8")
    data.inflight(same)
    assert not same.flags.derived


def test_data_worker_records_the_window_of_two_batches():
    d = draft("--rollout-batch-size", "4")
    d.rollout = rollout_config_from_args(d.args)
    data.data_worker(d)
    b = d.rollout.groups_per_step
    assert d.data_worker.fifo_window == 2 * b
    assert why(d, "--fifo-window") == f"2 x groups per step (B = {b})"
    assert why(d, "--max-inflight") == "the default (no --sglang-server-concurrency)"


def test_schedule_refuses_a_push_interval_the_budget_cannot_serve():
    with pytest.raises(ValueError, match="needs --max-staleness >= 2"):
        data.schedule(draft("--update-weights-interval", "3", data_worker=dw(max_staleness=1)))
    data.schedule(draft("--update-weights-interval", "3", data_worker=dw(max_staleness=2)))


def test_off_policy_drop_is_the_staleness_bound():
    d = draft(data_worker=dw())
    data.off_policy_drop(d)
    assert d.args.max_off_policy_steps == 4 == d.data_worker.max_off_policy_steps  # 2 + ⌈63/32⌉
    assert why(d, "--max-off-policy-steps").startswith("the staleness bound S 2 + ceil((W 64 - 1)")
    pushed = draft("--update-weights-interval", "2", data_worker=dw())
    data.off_policy_drop(pushed)
    assert "--update-weights-interval 2 adds none" in why(pushed, "--max-off-policy-steps")
    unbounded = draft(data_worker=dw(fifo_window=float("inf")))
    data.off_policy_drop(unbounded)
    assert unbounded.args.max_off_policy_steps is None and not unbounded.flags.derived


def test_loss_records_what_the_loss_package_derived():
    d = draft()
    d.rollout = rollout_config_from_args(d.args)
    data.loss(d)
    assert d.loss.loss.name == "compis"
    for flag, value, reason in d.loss.derived:
        assert d.flags.derived[flag] == Derived(value, reason)


# ----------------------------------------------------------------------------- training.py
def test_lr_by_run_kind_and_a_high_one_is_kept_with_a_warning(caplog):
    d = draft(embedded=True)
    training.lr(d)
    assert d.args.lr == TrainerConfig().lr
    user = draft(embedded=False)
    training.lr(user)
    assert user.args.lr == REAL_MODEL_LR and "pretrained" in why(user, "--lr")
    high = draft("--lr", "1e-3", embedded=False)
    with caplog.at_level(logging.WARNING, logger="slime_async.config"):
        training.lr(high)
    assert high.args.lr == 1e-3 and "far above" in caplog.text and not high.flags.derived


def _with_loss(*argv: str, **facts: object) -> Draft:
    d = draft(*argv, **facts)
    d.loss = loss_settings_from_args(d.args, default_loss_scale_factor=1.0)
    return d


def test_run_kind_defaults_and_no_snapshots_for_a_loss_that_reads_none():
    d = _with_loss(embedded=True)
    training.run_kind(d)
    assert d.args.keep_old_actor is True and why(d, "--keep-old-actor").endswith(
        "embedded default run"
    )
    user = _with_loss(embedded=False)
    training.run_kind(user)
    assert user.args.keep_old_actor is False and user.args.micro_batch_size == 4
    ppo = _with_loss("--loss", "ppo", embedded=True)
    training.run_kind(ppo)
    assert ppo.args.keep_old_actor is False
    assert why(ppo, "--keep-old-actor") == "--loss ppo does not read pi_j^Meg snapshots"


def test_behavior_forward_off_the_train_step_only_when_async():
    d = _with_loss("--keep-old-actor", data_worker=dw())
    training.behavior_forward(d)
    assert d.args.behavior_forward == "role" and "LoRA" not in why(d, "--behavior-forward")
    lora = _with_loss("--keep-old-actor", "--lora-rank", "4", data_worker=dw())
    training.behavior_forward(lora)
    assert "under LoRA" in why(lora, "--behavior-forward")
    sync = _with_loss("--keep-old-actor", data_worker=dw(max_staleness=0))
    training.behavior_forward(sync)
    assert sync.args.behavior_forward == "trainer"


def test_snapshots_cover_every_version_a_token_can_carry():
    d = draft("--keep-old-actor", "--behavior-forward", "trainer", data_worker=dw())
    training.snapshots(d)
    assert d.args.max_snapshots == 5  # bound 4 + the current version
    assert why(d, "--max-snapshots").startswith("staleness bound 4 (S 2 + ceil((W 64 - 1) / B 32))")
    role = draft(
        "--keep-old-actor",
        "--behavior-forward",
        "role",
        "--update-weights-interval",
        "2",
        data_worker=dw(),
    )
    training.snapshots(role)
    assert role.args.max_snapshots == 4  # floor(4 / 2) + 1, + 1 off the grid
    with pytest.raises(ValueError, match="--max-snapshots 2 is too few"):
        training.snapshots(
            draft(
                "--keep-old-actor",
                "--behavior-forward",
                "trainer",
                "--max-snapshots",
                "2",
                data_worker=dw(),
            )
        )
    with pytest.raises(ValueError, match="no staleness bound"):
        training.snapshots(draft("--keep-old-actor", data_worker=dw(fifo_window=float("inf"))))


def test_snapshots_rerun_derives_again():
    d = draft(
        "--keep-old-actor",
        "--behavior-forward",
        "role",
        "--update-weights-interval",
        "2",
        data_worker=dw(),
    )
    training.snapshots(d)
    d.args.behavior_forward = "trainer"
    training.snapshots.rerun(d)
    assert d.args.max_snapshots == 5 and list(d.flags.derived) == ["--max-snapshots"]


@pytest.mark.parametrize(
    "embedded, env, value, reason",
    [
        (True, ENV, False, "tiny model trains in fp32"),
        (False, dataclasses.replace(ENV, cpu_bf16="amx_bf16"), True, "the CPU has amx_bf16"),
        (False, ENV, False, "no AMX/AVX512_BF16"),
    ],
)
def test_bf16_from_the_cpu_and_the_run_kind(embedded, env, value, reason):
    d = draft(env=env, embedded=embedded)
    training.bf16(d)
    assert d.args.bf16 is value and reason in why(d, "--bf16")


CXX = dataclasses.replace(ENV, cxx="/usr/bin/g++")


@pytest.mark.parametrize(
    "embedded, env, value, reason",
    [
        (True, CXX, False, "tiny model: eager kernels"),
        (False, CXX, True, "a CPU trainer and a C++ compiler (/usr/bin/g++)"),
        (False, ENV, False, "no C++ compiler on this node"),
        (False, dataclasses.replace(CXX, gpu_memory_bytes=(80 << 30,)), False, "on GPUs"),
    ],
)
def test_fused_kernels_for_a_cpu_trainer_with_a_compiler(embedded, env, value, reason):
    d = draft(env=env, embedded=embedded)
    training.fused_kernels(d)
    assert d.args.cpu_fused_kernels is value and reason in why(d, "--cpu-fused-kernels")


def test_fused_kernels_given_are_kept_and_refused_without_a_compiler():
    d = draft("--no-cpu-fused-kernels", env=CXX, embedded=False)
    training.fused_kernels(d)
    assert d.args.cpu_fused_kernels is False and not d.flags.derived
    d = draft("--cpu-fused-kernels", env=CXX, embedded=True)
    training.fused_kernels(d)
    assert d.args.cpu_fused_kernels is True
    with pytest.raises(ValueError, match=r"needs a C\+\+ compiler .* --no-cpu-fused-kernels"):
        training.fused_kernels(draft("--cpu-fused-kernels", embedded=False))


def test_save_hf_keeps_every_runs_model():
    d = draft("--run-dir", "/tmp/r", embedded=True)
    training.save_hf(d)
    assert d.args.save_hf == "/tmp/r/hf"
    user = draft(*USER, "--run-dir", "/tmp/u", embedded=False)  # else it would keep nothing
    training.save_hf(user)
    assert user.args.save_hf == "/tmp/u/hf" and "without --save" in why(user, "--save-hf")
    saved = draft(*USER, "--save", "/tmp/ck", embedded=False)  # kept in its checkpoints: said
    training.save_hf(saved)
    assert saved.args.save_hf is None and "--save /tmp/ck's checkpoints" in why(saved, "--save-hf")


def test_trainer_refuses_routing_replay_on_a_dense_model():
    d = _with_loss(
        *USER,
        "--routing-replay",
        "r3",
        "--lr",
        "1e-6",
        env=dataclasses.replace(ENV, model=SMOLLM2_135M),
    )
    d.rollout = rollout_config_from_args(d.args)
    with pytest.raises(ValueError, match="--routing-replay r3 needs an MoE model"):
        training.trainer(d)


def test_resume_starts_fresh_from_an_empty_load_dir_that_it_saves_to():
    env = dataclasses.replace(ENV, load=LoadFacts(path="/ck", empty=True, exists=False))
    d = draft("--load", "/ck", "--save", "/ck", env=env, embedded=True, trainer=TrainerConfig())
    training.resume(d)
    assert d.trainer.load is None and d.flags.derived["--load"].value is None
    assert "does not exist, no checkpoint yet: starting fresh" in why(d, "--load")
    with pytest.raises(ValueError, match="no checkpoint to resume"):
        training.resume(draft("--load", "/ck", env=env, embedded=True, trainer=TrainerConfig()))


# ------------------------------------------------------------------------------ serving.py
def test_engines_from_the_gpus():
    d = draft("--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2")
    serving.engines(d)
    assert d.engines.num_engines == 2
    assert why(d, "--num-engines") == "--rollout-num-gpus 4 / --rollout-num-gpus-per-engine 2"


_ROLES = {"trainer": TrainerConfig(), "engines": EngineFleetConfig()}


def test_placement_splits_the_cores_or_shares_one():
    d = draft(**_ROLES)
    serving.placement(d)
    assert d.placement == Placement(colocate=False, trainer_cores=(0, 1), rollout_cores=(2, 3))
    assert why(d, "--colocate") == "4 usable CPU core(s): [0, 1, 2, 3]"
    assert d.args.offload_train is False and d.args.engine_sleep_level == 0
    one = draft(env=dataclasses.replace(ENV, cpus=(5,)), **_ROLES)
    serving.placement(one)
    assert one.placement == Placement(colocate=True)
    assert one.args.offload_train is False  # a derived --colocate shares the core only
    with pytest.raises(ValueError, match="overlap"):
        serving.placement(draft("--trainer-cores", "0,1", "--rollout-cores", "1,2", **_ROLES))
    # partial overlap: under a pipeline scheduler an engine may sit on the trainer's core
    shared = draft("--trainer-cores", "0", "--rollout-cores", "0,1", "--pipeline-scheduler",
                   "pool", **_ROLES)  # fmt: skip
    serving.placement(shared)
    assert shared.placement == Placement(colocate=False, trainer_cores=(0,), rollout_cores=(0, 1))
    joined = dataclasses.replace(ENV, ray_address="h:1")
    with pytest.raises(ValueError, match="joined Ray cluster"):
        serving.placement(draft("--trainer-cores", "0", env=joined, **_ROLES))


def test_a_given_colocate_takes_turns_as_in_slime():
    d = draft("--colocate", **_ROLES)
    serving.placement(d)
    assert d.args.offload_train is True and d.args.offload_rollout is True
    assert d.args.engine_sleep_level == 2 and "--colocate (slime's" in why(d, "--offload-train")
    kept = draft("--colocate", "--engine-sleep-level", "1", **_ROLES)
    serving.placement(kept)
    assert kept.args.engine_sleep_level == 1 and "--engine-sleep-level" not in kept.flags.derived
    gpu = draft("--colocate", env=dataclasses.replace(ENV, gpu_memory_bytes=(80 << 30,)), **_ROLES)
    serving.placement(gpu)
    assert gpu.args.offload_train is False and "GPUs" in why(gpu, "--offload-train")
    with pytest.raises(ValueError, match="built for CPU memory only"):
        serving.placement(
            draft("--offload", env=dataclasses.replace(ENV, gpu_memory_bytes=(1,)), **_ROLES)
        )


def test_cache_salt_by_backend():
    fleet = EngineFleetConfig.from_args(
        build_parser().parse_args(["--engine-backend", "external", "--engine-urls", "http://a:1"])
    )
    d = draft(engines=fleet)
    serving.cache_salt(d)
    assert d.args.router_cache_salt is True and "extra_key" in why(d, "--router-cache-salt")
    embedded = draft(engines=EngineFleetConfig())
    serving.cache_salt(embedded)
    assert embedded.args.router_cache_salt is False


def test_the_run_holds_the_admin_key_and_mints_a_data_plane_key():
    with pytest.raises(ValueError, match="needs the run's admin key"):
        serving.keys(draft(env=dataclasses.replace(ENV, ray_address="h:1")))
    with pytest.raises(ValueError, match="differs from the run's admin key"):
        serving.keys(
            draft("--router-auth-token", "a", env=dataclasses.replace(ENV, auth_token="b"))
        )
    with pytest.raises(ValueError, match="would also open the control routes"):
        serving.keys(draft(env=dataclasses.replace(ENV, api_key="d4ta")))
    d = draft(env=dataclasses.replace(ENV, auth_token="t0k"), engines=EngineFleetConfig())
    serving.keys(d)
    assert d.admin_api_key == "t0k" == d.router.admin_api_key
    assert d.api_key == d.router.api_key and len(d.api_key) > 20  # minted for this run
    assert d.api_key not in why(d, "--api-key-file")  # the record never holds the key
    given = draft(env=dataclasses.replace(ENV, auth_token="t0k", api_key="d4ta"), engines=None)
    serving.keys(given)
    assert given.api_key == "d4ta" and "--api-key-file" not in given.flags.derived


def test_warmstart_only_for_a_fresh_embedded_run():
    d = draft(embedded=True, trainer=TrainerConfig())
    serving.warmstart(d)
    assert d.args.warmstart_steps == 300
    resumed = draft(embedded=True, trainer=TrainerConfig(load="/ck"))
    serving.warmstart(resumed)
    assert resumed.args.warmstart_steps == 0 and "resumes from --load" in why(
        resumed, "--warmstart-steps"
    )


def _engine_draft(*argv: str, env: Environment = ENV, **facts: object) -> Draft:
    """A draft as the `engine` rule finds it (the rules it reads have run)."""
    d = draft(*argv, env=env, **{"placement": Placement(colocate=False), **facts})
    d.embedded = not argv
    d.engines = EngineFleetConfig.from_args(d.args)
    d.rollout = rollout_config_from_args(d.args)
    return d


def test_engine_threads_follow_the_placement():
    d = _engine_draft()
    serving.engine(d)
    assert d.engine.num_threads == 1
    shared = _engine_draft(placement=Placement(colocate=True))
    serving.engine(shared)
    assert shared.engine.num_threads is None


@pytest.mark.parametrize(
    "argv, env, value, reason",
    [
        ((), ENV, "bf16", "the mismatch its CompIS corrects"),
        (USER, dataclasses.replace(ENV, cpu_bf16="avx512_bf16"), "bf16", "the CPU has avx512_bf16"),
        (USER, ENV, "fp32", "no AMX/AVX512_BF16 (bf16 matmuls would be emulated)"),
        (USER, dataclasses.replace(ENV, ray_address="10.0.0.2:6379"), "bf16", "not read here"),
    ],
)
def test_engine_dtype_from_the_cpu_and_the_run_kind(argv, env, value, reason):
    """`--engine-dtype` as rule `bf16` derives `--bf16`: from the CPU's native bf16 for a user's
    model; bf16 for the embedded default run and where the engines' nodes are not this one."""
    d = _engine_draft(*argv, env=env)
    serving.engine(d)
    assert d.engine.dtype == value and reason in why(d, "--engine-dtype")


def test_engine_dtype_given_is_kept_and_only_embedded_engines_derive_it():
    bf16_cpu = dataclasses.replace(ENV, cpu_bf16="amx_bf16")
    for env, value in ((ENV, "bf16"), (bf16_cpu, "fp32")):  # against what the CPU derives
        given = _engine_draft(*USER, "--engine-dtype", value, env=env)
        serving.engine(given)
        assert given.engine.dtype == value and "--engine-dtype" not in given.flags.derived
    ext = _engine_draft(*USER, "--engine-backend", "external", "--engine-urls", "http://h:1")
    serving.engine(ext)
    assert "--engine-dtype" not in ext.flags.derived  # servers the run does not start


def _lora_draft(*argv: str, targets: tuple[str, ...]) -> Draft:
    d = draft(*argv)
    d.trainer = TrainerConfig(lora_rank=8, lora_target_modules=targets)
    d.engines = EngineFleetConfig.from_args(d.args)
    d.engine = engine_run_config_from_args(d.args, seed=1, num_threads=1)
    return d


def test_lora_checks_the_adapter_against_the_model_and_turns_the_engines_lora_on():
    with pytest.raises(ValueError, match=NO_EXPERT_ADAPTERS):
        serving.lora(_lora_draft(targets=("q_proj", "down_proj")))  # the MoE: routed experts
    d = _lora_draft(targets=ATTENTION_MODULES)
    serving.lora(d)
    assert d.engine.enable_lora and d.engine.max_lora_rank == 8
    assert d.engine.lora_target_modules == ATTENTION_MODULES and d.engine.max_loaded_loras == 1
    with pytest.raises(ValueError, match="pushes each adapter version in place"):
        serving.lora(_lora_draft("--engine-backend", "sglang", targets=ATTENTION_MODULES))
    plain = draft(trainer=TrainerConfig())
    serving.lora(plain)  # no LoRA: nothing to check, no engine needed


def test_transport_by_what_travels_and_who_owns_the_engines():
    lora = draft(trainer=TrainerConfig(lora_rank=4), engines=EngineFleetConfig())
    serving.transport(lora)
    assert lora.args.update_weight_transport == "disk" and why(
        lora, "--update-weight-transport"
    ).startswith("LoRA")
    ext = EngineFleetConfig.from_args(
        build_parser().parse_args(["--engine-backend", "external", "--engine-urls", "http://a:1"])
    )
    attached = draft(trainer=TrainerConfig(), engines=ext)
    serving.transport(attached)
    assert attached.args.update_weight_transport == "disk"
    own = draft(trainer=TrainerConfig(), engines=EngineFleetConfig())
    serving.transport(own)
    assert own.args.update_weight_transport == "distributed"


def test_weight_dtype_travels_as_the_engines_serve_unless_the_role_reads_disk():
    bf16_engines = engine_run_config_from_args(
        build_parser().parse_args(["--engine-dtype", "bf16"]), seed=1, num_threads=1
    )
    facts = {"engines": EngineFleetConfig(), "engine": bf16_engines}
    d = draft(trainer=TrainerConfig(bf16=True), **facts)
    serving.weight_dtype(d)
    assert d.args.update_weight_dtype == "bfloat16"
    served = draft("--update-weight-transport", "distributed", trainer=TrainerConfig(), **facts)
    serving.weight_dtype(served)
    assert served.args.update_weight_dtype == "bfloat16"
    role = TrainerConfig(behavior_forward="role", keep_old_actor=True)
    disk = draft("--update-weight-transport", "disk", trainer=role, **facts)
    serving.weight_dtype(disk)
    assert disk.args.update_weight_dtype == "float32"
    assert why(disk, "--update-weight-dtype").startswith("the forward-only role reads the disk")


# ------------------------------------------------------------------------------- memory.py
ASYNC = (*USER, "--keep-old-actor", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024")
"""Micro-batching given, so the memory rule derives none and only its role fallback is seen."""


def _validate(*argv: str, memory: int | None):
    env = Environment(model=SMOLLM2_135M, cpus=(0, 1), memory_bytes=memory)
    return validate(build_parser().parse_args(list(argv)), env)


def test_memory_fallback_gives_what_validating_with_the_trainer_forward_gives():
    free = _validate(*ASYNC, memory=None)
    lean = _validate(*ASYNC, "--behavior-forward", "trainer", memory=None)
    need_role, need_trainer = (sum(memory.memory_parts(c).values()) for c in (free, lean))
    cfg = _validate(*ASYNC, memory=int((need_role + need_trainer) / 2 / MEMORY_FRACTION))
    assert dataclasses.replace(cfg, derived={}) == dataclasses.replace(lean, derived={})
    assert list(cfg.derived) == [*lean.derived, "--behavior-forward"]  # the fallback's, last
    assert all(cfg.derived[k] == v for k, v in lean.derived.items())
    assert "would not fit" in cfg.derived["--behavior-forward"].why


def test_memory_refuses_a_run_that_cannot_fit():
    d = draft(*ASYNC, env=Environment(model=SMOLLM2_135M, cpus=(0, 1), memory_bytes=None))
    for r in RULES:
        r(d)
    d.env = dataclasses.replace(d.env, memory_bytes=2 * 1024**3)
    with pytest.raises(ValueError, match=r"would not fit .*--bf16"):
        memory.memory(d)


def test_a_derived_micro_batch_gives_what_validating_with_it_given_gives():
    argv = (*USER, "--keep-old-actor")
    cfg = _validate(*argv, memory=64 * 1024**3)
    n = cfg.trainer.max_tokens_per_gpu
    given = _validate(
        *argv, "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(n), memory=None
    )
    assert dataclasses.replace(cfg.trainer) == given.trainer
    assert cfg.derived["--use-dynamic-batch-size"].value is True
    assert "fits" in cfg.derived["--max-tokens-per-gpu"].why
