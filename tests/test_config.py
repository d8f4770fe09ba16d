"""train_async.py flags: slime-compatible names, derived sizes, and every cross-flag rule.

`validate` is pure: these tests hand it the environment (model spec, usable cores) instead of
letting it read the machine, except where reading the environment is what is tested.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest

from data_worker.config import DataWorkerConfig
from router.config import RouterConfig
from slime_async.config import Environment, build_parser, read_environment, validate
from slime_async.config.engine_fleet import EngineFleetConfig
from slime_async.config.model_shape import ModelShapeFlags
from slime_async.config.pipeline import PipelineConfig
from slime_async.config.run_config import RunConfig
from slime_async.config.script_flags import ScriptRunFlags
from slime_async.config.supervision import SupervisorConfig
from slime_async.contracts.model import TINY_MOE, ModelSpec
from slime_async.engine.config import EngineConfig
from slime_async.metrics.config import LoggingConfig
from slime_async.rollout.config import RolloutConfig
from slime_async.trainer.config import TrainerConfig
from slime_async.weights.config import WeightSyncConfig

TWO_CORES = Environment(model=TINY_MOE, cpus=(0, 1))


def _cfg(*argv: str, env: Environment = TWO_CORES) -> RunConfig:
    return validate(build_parser().parse_args(list(argv)), env)


def test_defaults_are_the_embedded_async_run():
    cfg = _cfg()
    assert cfg.model.is_moe and cfg.rollout.prompt_data is None
    assert cfg.rollout.global_batch_size == 64 and cfg.rollout.groups_per_step == 8
    assert cfg.data_worker.max_staleness == 2 and cfg.data_worker.fifo_window == 16
    # snapshots cover the worst-case staleness S + ceil((W - 1) / B) = 2 + 2, plus the current one
    assert cfg.trainer.max_snapshots == 5
    assert cfg.trainer.keep_old_actor and cfg.trainer.routing_replay.value == "r3"
    assert cfg.trainer.micro_batch_size == 16 and cfg.warmstart_steps == 300
    assert cfg.num_steps == 200 and not cfg.colocate
    assert cfg.trainer_cores == (0,) and cfg.rollout_cores == (1,)
    assert cfg.derived["--max-snapshots"].value == 5
    assert "staleness bound 4" in cfg.derived["--max-snapshots"].why


def test_rollout_seed_and_routing_replay_have_one_owner_each():
    """`RunConfig.rollout_seed` falls back to `--seed`; the engines sample with it; R3 is the
    one replay that needs the engines' routing."""
    from slime_async.trainer.replay import RoutingReplay

    assert _cfg("--seed", "7").rollout_seed == 7 == _cfg("--seed", "7").engine.seed
    cfg = _cfg("--seed", "7", "--rollout-seed", "3")
    assert cfg.rollout_seed == 3 == cfg.engine.seed and cfg.seed == 7
    assert [m.replays_engine_routing for m in RoutingReplay] == [False, False, True]


def test_slime_names_map_onto_component_configs():
    cfg = _cfg(
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--num-steps-per-rollout",
        "2",
        "--num-rollout",
        "3",
        "--eps-clip",
        "0.1",
        "--eps-clip-high",
        "0.28",
        "--use-rollout-routing-replay",
        "--keep-old-actor",
        "--staleness-correction-method",
        "icepop",
        "--staleness-correction-low",
        "0.5",
        "--staleness-correction-high",
        "5",
        "--fifo-window",
        "inf",
        "--max-off-policy-steps",
        "3",
    )
    assert cfg.rollout.global_batch_size == 8 and cfg.num_steps == 6
    loss = cfg.trainer.loss.config
    assert loss.eps_clip_high == 0.28 and cfg.trainer.routing_replay.value == "r3"
    assert "--routing-replay" not in cfg.derived  # the user chose it, through slime's alias
    assert str(loss.staleness_method) == "icepop"
    assert math.isinf(cfg.data_worker.fifo_window)
    assert cfg.data_worker.max_off_policy_steps == 3
    assert cfg.trainer.max_snapshots == 4  # the off-policy cap bounds staleness at 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--global-batch-size", "60"], "must be a multiple of --n-samples-per-prompt"),
        (["--rollout-batch-size", "3", "--num-steps-per-rollout", "5"], "not divisible"),
        (["--num-steps", "5", "--num-rollout", "2"], "either --num-steps or --num-rollout"),
        (["--num-rollout", "0"], "--num-rollout must be >= 1"),
        (["--max-staleness", "-1"], "max_staleness .S. must be an integer >= 0"),
        (["--max-off-policy-steps", "1"], "groups the budget admits would be dropped"),
        (["--update-weights-interval", "3", "--max-staleness", "1"], "needs --max-staleness >= 2"),
        (["--eps-clip-c", "0.5"], "dual clip"),
        (["--colocate", "--trainer-cores", "0"], "--colocate shares all cores"),
        (["--trainer-cores", "0,1", "--rollout-cores", "1"], "overlap"),
        (["--trainer-cores", "0", "--rollout-cores", "5"], r"core\(s\) \[5\] this process"),
        (["--fifo-window", "0"], "fifo_window .W. must be >= 1"),
        (["--fifo-window", "2.5"], "whole number"),  # was silently truncated to 2
        (["--keep-old-actor", "--fifo-window", "inf"], "no staleness bound"),
        (["--routing-replay", "r2", "--use-rollout-routing-replay"], "keep one of the two"),
        (["--router-worker-urls", "http://127.0.0.1:1"], "--engine-backend external --engine-urls"),
    ],
)
def test_contradictory_flags_fail_with_an_actionable_message(argv, message):
    with pytest.raises(ValueError, match=message):
        _cfg(*argv)


def test_cores_that_are_not_comma_separated_integers_are_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--trainer-cores", "zero"])
    assert "argument --trainer-cores: 'zero' must be comma-separated integers" in (
        capsys.readouterr().err
    )


def test_parse_config_exits_with_the_message(capsys):
    from slime_async.config import parse_config

    with pytest.raises(SystemExit):
        parse_config(["--num-engines", "0"])
    assert "--num-engines must be >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------- former silent overrides
def test_max_snapshots_is_derived_when_unset_kept_when_enough_refused_when_too_few():
    assert _cfg().derived["--max-snapshots"].value == 5
    given = _cfg("--max-snapshots", "9")  # was overwritten with 5
    assert given.trainer.max_snapshots == 9 and "--max-snapshots" not in given.derived
    with pytest.raises(ValueError, match=r"--max-snapshots 2 is too few.*--max-snapshots 5"):
        _cfg("--max-snapshots", "2")  # was raised to 5 behind the user's back
    off = _cfg("--no-keep-old-actor", "--max-snapshots", "1")  # no snapshots: nothing to size
    assert not off.trainer.keep_old_actor and "--max-snapshots" not in off.derived


@pytest.mark.parametrize(
    ("interval", "forward", "snapshots"),
    [
        # bound S 2 + ceil((W 16 - 1) / B 8) = 4 for every interval: the drop is 4, not 4 + I - 1
        (1, "trainer", 5),
        (2, "trainer", 5),
        (3, "trainer", 5),  # every version: bound + 1
        (1, "role", 5),
        (2, "role", 4),
        (3, "role", 3),  # pushed ones: floor(4 / I) + 2
    ],
)
def test_drop_and_snapshots_come_from_one_bound_for_any_push_interval(interval, forward, snapshots):
    from data_worker.budget import snapshot_count

    cfg = _cfg("--update-weights-interval", str(interval), "--behavior-forward", forward)
    assert cfg.data_worker.max_off_policy_steps == 4
    assert cfg.trainer.max_snapshots == snapshots
    # every group the drop lets through has its versions' snapshots (with the drop at
    # bound + I - 1 and bound + 1 snapshots, a group the backstop should drop was trained on
    # the combined ratio instead)
    every = interval if forward == "role" else 1
    n = cfg.data_worker.max_off_policy_steps
    assert cfg.trainer.max_snapshots >= snapshot_count(bound=n, versions_every=every)
    assert cfg.derived["--max-snapshots"].why.startswith("staleness bound 4 (S 2 + ceil((W 16")
    why = cfg.derived["--max-off-policy-steps"].why
    assert ("--update-weights-interval" in why) == (interval > 1)
    with pytest.raises(ValueError, match=f"--max-snapshots {snapshots}"):
        _cfg(
            "--update-weights-interval",
            str(interval),
            "--behavior-forward",
            forward,
            "--max-snapshots",
            str(snapshots - 1),
        )


def test_warm_start_is_off_for_user_data_and_resumes_and_refused_when_asked_for():
    data = _cfg("--prompt-data", "data.jsonl")
    assert data.warmstart_steps == 0
    assert "--prompt-data" in data.derived["--warmstart-steps"].why
    assert _cfg("--load", "ckpt").derived["--warmstart-steps"].value == 0
    assert _cfg("--prompt-data", "data.jsonl", "--warmstart-steps", "0").warmstart_steps == 0
    with pytest.raises(ValueError, match=r"--warmstart-steps 50 cannot apply.*--prompt-data"):
        _cfg("--prompt-data", "data.jsonl", "--warmstart-steps", "50")  # was forced to 0
    with pytest.raises(ValueError, match=r"--warmstart-steps 50 cannot apply.*--load"):
        _cfg("--load", "ckpt", "--warmstart-steps", "50")  # was silently skipped at launch
    assert _cfg("--warmstart-steps", "7").warmstart_steps == 7


def test_colocation_is_derived_from_the_cores_and_never_overrides_given_cores():
    one = Environment(model=TINY_MOE, cpus=(3,))
    cfg = _cfg(env=one)
    assert cfg.colocate and cfg.trainer_cores == () and cfg.derived["--colocate"].value is True
    assert cfg.engine.num_threads is None
    with pytest.raises(ValueError, match="need 2 or more CPU cores"):
        _cfg("--trainer-cores", "3", env=one)  # was silently colocated, dropping the cores
    assert "--colocate" not in _cfg("--colocate").derived
    four = _cfg(env=Environment(model=TINY_MOE, cpus=(4, 5, 6, 7)))
    assert four.trainer_cores == (4, 5) and four.rollout_cores == (6, 7)
    assert _cfg("--trainer-cores", "1", "--rollout-cores", "0").trainer_cores == (1,)


def test_run_kind_defaults_are_recorded_and_user_runs_get_the_trainer_defaults():
    cfg = _cfg()
    for flag in ("--keep-old-actor", "--routing-replay", "--micro-batch-size"):
        assert "embedded default run" in cfg.derived[flag].why
    dense = Environment(model=ModelSpec(family="llama"), cpus=(0, 1))
    user = _cfg("--hf-checkpoint", "/not/read/by/validate", env=dense)
    d = TrainerConfig()
    assert (user.trainer.keep_old_actor, user.trainer.micro_batch_size) == (
        d.keep_old_actor,
        d.micro_batch_size,
    )
    assert user.trainer.routing_replay == d.routing_replay
    assert "--hf-checkpoint" in user.derived["--micro-batch-size"].why
    off = _cfg("--no-keep-old-actor", "--routing-replay", "none", "--micro-batch-size", "3")
    assert not off.trainer.keep_old_actor and off.trainer.routing_replay.value == "none"
    assert not {"--keep-old-actor", "--routing-replay", "--micro-batch-size"} & set(off.derived)
    with pytest.raises(ValueError, match="needs an MoE model"):
        _cfg("--hf-checkpoint", "/x", "--use-rollout-routing-replay", env=dense)


# ---------------------------------------------------------------- purity and single defaults
def test_validate_reads_nothing_from_the_machine_or_disk(monkeypatch, tmp_path):
    def forbidden(*_a, **_k):
        raise AssertionError("validate must not do I/O")

    import transformers

    monkeypatch.setattr("os.sched_getaffinity", forbidden)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", forbidden)
    missing = str(tmp_path / "no-such-model")
    cfg = _cfg("--hf-checkpoint", missing, "--prompt-data", str(tmp_path / "no.jsonl"))
    assert cfg.trainer.hf_checkpoint == missing and cfg.model == TINY_MOE  # the env's model


def test_read_environment_reads_the_model_and_names_a_bad_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    dense = ModelSpec(family="llama")
    AutoModelForCausalLM.from_config(dense.to_hf_config()).save_pretrained(tmp_path / "dense")
    args = build_parser().parse_args(["--hf-checkpoint", str(tmp_path / "dense")])
    env = read_environment(args)
    assert env.model.family == "llama" and not env.model.is_moe and env.cpus
    args = build_parser().parse_args(["--hf-checkpoint", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match=r"--hf-checkpoint .*missing does not exist"):
        read_environment(args)
    (tmp_path / "empty").mkdir()
    args = build_parser().parse_args(["--hf-checkpoint", str(tmp_path / "empty")])
    with pytest.raises(ValueError, match=r"--hf-checkpoint .*empty: cannot read its config"):
        read_environment(args)


# flag group title -> (config class, {dest: field} where the names differ, dest prefix)
_OWNERS = {
    "run": (RunConfig, {}, ""),
    "pipeline scheduler": (PipelineConfig, {}, "pipeline_"),
    "placement": (RunConfig, {}, ""),
    "rollout engines": (
        EngineFleetConfig,
        {
            "engine_backend": "backend",
            "engine_urls": "urls",
            "engine_attach_timeout": "attach_timeout_s",
            "rollout_num_gpus_per_engine": "gpus_per_engine",
            "rollout_num_cpus_per_engine": "cpus_per_engine",
            "engine_start_timeout": "start_timeout_s",
        },
        "",
    ),
    "rollout and data": (
        RolloutConfig,
        {
            "rollout_max_response_len": "max_response_len",
            "rollout_temperature": "temperature",
            "rollout_top_p": "top_p",
            "rollout_top_k": "top_k",
            "rollout_stop": "stop",
            "rollout_seed": "seed",
            "rollout_stop_token_ids": "stop_token_ids",
        },
        "",
    ),
    "async schedule and staleness (data worker)": (DataWorkerConfig, {}, ""),
    "trainer": (
        TrainerConfig,
        {
            "num_virtual_stages_per_pipeline_rank": "virtual_pipeline_model_parallel_size",
            "lr_warmup_iters": "lr_warmup_steps",
            "lr_decay_iters": "lr_decay_steps",
        },
        "",
    ),
    "embedded engine": (EngineConfig, {}, "engine_"),
    "engine supervision": (
        SupervisorConfig,
        {
            "engine_restart_after": "restart_after_s",
            "engine_hung_timeout": "hung_timeout_s",
            "engine_down_timeout": "all_down_timeout_s",
        },
        "",
    ),
    "router": (RouterConfig, {"router_auth_token": "admin_api_key"}, "router_"),
    "weight sync": (
        WeightSyncConfig,
        {"update_weight_buffer_size": "bucket_bytes", "update_weight_timeout": "timeout_s"},
        "update_weight_",
    ),
    "logging": (LoggingConfig, {}, ""),
    "model shape (Megatron)": (ModelShapeFlags, {}, ""),
    "slime script flags": (ScriptRunFlags, {}, ""),
}
# flags that select behaviour rather than set a config field
_NOT_FIELDS = {
    "help",
    "num_rollout",
    "use_rollout_routing_replay",
    "rollout_function_path",
    "rollout_num_gpus",
}


_REQUIRED = object()


def _field_default(cls: type, name: str) -> object:
    """The field's default; a required field (always resolved by validation) has none."""
    f = cls.__dataclass_fields__[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return _REQUIRED if f.default_factory is dataclasses.MISSING else f.default_factory()


def test_every_flag_default_is_its_config_field_default():
    parser = build_parser()
    derived = set(_cfg().derived) | set(_cfg("--prompt-data", "d.jsonl").derived)
    checked = 0
    for group in parser._action_groups:
        if group.title not in _OWNERS:
            # the loss package owns its flags; their defaults live in each loss's config class
            assert group.title in ("positional arguments", "options", "loss"), group.title
            continue
        cls, renamed, prefix = _OWNERS[group.title]
        for action in group._group_actions:
            if action.dest in _NOT_FIELDS:
                continue
            name = renamed.get(action.dest, action.dest.removeprefix(prefix))
            assert name in cls.__dataclass_fields__, f"{action.option_strings} -> {cls.__name__}"
            want, got = _field_default(cls, name), action.default
            if got is None and want == ():  # a list flag: not given means the empty list
                continue
            if got is None and want is not None:  # a derived default: validation fills it
                flag = action.option_strings[0]
                assert flag in derived, f"{flag} defaults to None but nothing derives it"
                continue
            if isinstance(want, (tuple, Path)):
                got = type(want)(got)
            assert got == want, (action.option_strings, got, want)
            checked += 1
    assert checked > 60


def test_record_config_logs_derived_values_once_and_saves_them(tmp_path, caplog):
    from slime_async.orchestrator.launch import record_config

    cfg = dataclasses.replace(_cfg(), run_dir=tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="slime_async.orchestrator.launch"):
        record_config(cfg)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("derived:")]
    assert len(lines) == len(cfg.derived)
    assert sum(line.startswith("derived: --max-snapshots 5 (staleness bound 4") for line in lines)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["derived"]["--max-snapshots"]["value"] == 5
    assert saved["derived"]["--warmstart-steps"] == {
        "value": 300,
        "why": "default of the embedded default run",
    }
    assert (
        saved["derived"]["--routing-replay"]["value"] == saved["trainer"]["routing_replay"] == "r3"
    )
    assert saved["trainer"]["max_snapshots"] == 5 and saved["data_worker"]["max_staleness"] == 2


def test_snapshots_are_kept_by_default_only_for_a_loss_that_reads_them():
    compis = _cfg()
    assert compis.trainer.keep_old_actor and "--keep-old-actor" in compis.derived
    ppo = _cfg("--loss", "ppo")
    assert not ppo.trainer.keep_old_actor
    assert "does not read" in ppo.derived["--keep-old-actor"].why
    forced = _cfg("--loss", "ppo", "--keep-old-actor")  # the user's choice stands
    assert forced.trainer.keep_old_actor and "--keep-old-actor" not in forced.derived


def test_unset_max_off_policy_steps_is_the_staleness_bound_and_a_given_one_is_kept(tmp_path):
    """The run never trains past the bound it states: unset, N is S + ceil((W - 1) / B) for any
    push interval (the budget counts against the pushed version), derived and recorded; a value
    the user gave is kept; an unbounded window derives nothing."""
    from slime_async.config import parse_config

    base = ["--run-dir", str(tmp_path), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]
    cfg = parse_config([*base, "--max-staleness", "3", "--fifo-window", "6"])
    assert cfg.data_worker.max_off_policy_steps == 3 + 2  # ceil(5 / 4) = 2
    assert cfg.derived["--max-off-policy-steps"].value == 5
    cfg = parse_config([*base, "--max-staleness", "3", "--update-weights-interval", "3"])
    assert cfg.data_worker.max_off_policy_steps == 3 + 2  # W = 2B = 8: ceil(7 / 4) = 2; no lag
    cfg = parse_config([*base, "--max-staleness", "3", "--max-off-policy-steps", "9"])
    assert cfg.data_worker.max_off_policy_steps == 9
    assert "--max-off-policy-steps" not in cfg.derived
    cfg = parse_config([*base, "--fifo-window", "inf", "--no-keep-old-actor"])
    assert cfg.data_worker.max_off_policy_steps is None


# ------------------------------------------------------------------------- eval data


def test_eval_interval_with_prompt_data_and_no_eval_set_exits_2_naming_the_fix(tmp_path, capsys):
    from slime_async.config import parse_config

    (tmp_path / "d.jsonl").write_text("")
    with pytest.raises(SystemExit) as e:
        parse_config(["--prompt-data", str(tmp_path / "d.jsonl"), "--eval-interval", "5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--eval-interval 5" in err and "--eval-prompt-data NAME PATH" in err
    with pytest.raises(ValueError, match="--eval-interval 3: --eval-prompts is 0"):
        _cfg("--eval-prompts", "0", "--eval-interval", "3")  # built-in tasks, nothing held out


def test_prompt_data_without_eval_set_evaluates_nothing_and_says_why():
    cfg = _cfg("--prompt-data", "d.jsonl")
    assert cfg.rollout.eval_interval == 0
    d = cfg.derived["--eval-interval"]
    assert d.value == 0 and d.why.startswith("no eval set: a --prompt-data file")
    assert "--eval-max-response-len" not in cfg.derived  # nothing is evaluated
    assert _cfg("--prompt-data", "d.jsonl", "--eval-interval", "0").rollout.eval_interval == 0
    default = _cfg()  # the built-in tasks have a held-out set
    assert default.rollout.eval_interval == 10 and default.derived["--eval-interval"].value == 10


def test_eval_prompt_data_names_and_paths():
    from slime_async.rollout.config import parse_eval_prompt_data as parse

    assert parse(("/data/gsm8k.test.jsonl",)) == (("gsm8k", "/data/gsm8k.test.jsonl"),)
    pairs = ("aime", "/d/aime.jsonl", "gsm8k", "/d/gsm8k.parquet")
    assert parse(pairs) == (("aime", "/d/aime.jsonl"), ("gsm8k", "/d/gsm8k.parquet"))
    for bad, why in [
        (("a", "/d/a.jsonl", "b"), "NAME PATH pairs"),
        (("/d/a.jsonl", "/d/b.jsonl"), "looks like a data file"),
        (("a", "/d/a.jsonl", "a", "/d/b.jsonl"), r"\['a'\] repeat"),
        (("x/y", "/d/a.jsonl"), "without '/'"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse(bad)
    cfg = _cfg("--prompt-data", "d.jsonl", "--eval-prompt-data", *pairs)
    assert cfg.rollout.eval_sets == parse(pairs) and cfg.rollout.eval_interval == 10
    with pytest.raises(ValueError, match=r"--eval-prompt-data a b\.jsonl c: give NAME PATH"):
        _cfg("--prompt-data", "d.jsonl", "--eval-prompt-data", "a", "b.jsonl", "c")
    with pytest.raises(ValueError, match="trains on the built-in tasks"):
        _cfg("--eval-prompt-data", "/d/a.jsonl")


def test_eval_settings_default_to_the_training_ones_and_are_recorded():
    argv = ["--prompt-data", "d.jsonl", "--eval-prompt-data", "mini", "m.jsonl"]
    cfg = _cfg(
        *argv,
        "--input-key",
        "question",
        "--rollout-max-response-len",
        "32",
        "--rollout-temperature",
        "0.8",
        "--eval-top-p",
        "0.9",
    )
    r = cfg.rollout
    assert (r.eval_input_key, r.eval_label_key) == ("question", "label")
    assert (r.eval_max_response_len, r.eval_temperature, r.eval_top_p) == (32, 0.8, 0.9)
    for flag, value in [
        ("--eval-input-key", "question"),
        ("--eval-label-key", "label"),
        ("--eval-max-response-len", 32),
        ("--eval-temperature", 0.8),
        ("--eval-interval", 10),
    ]:
        assert cfg.derived[flag].value == value, flag
    assert "--eval-top-p" not in cfg.derived  # the user's flag is never derived
    own = _cfg(*argv, "--eval-label-key", "answer", "--eval-temperature", "0.6").rollout
    assert (own.eval_label_key, own.eval_temperature) == ("answer", 0.6)
    with pytest.raises(ValueError, match="--eval-temperature must be > 0"):
        _cfg(*argv, "--eval-temperature", "0")
