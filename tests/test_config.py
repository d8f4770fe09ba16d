"""train_async.py flags: slime-compatible names, derived sizes, and every cross-flag rule."""

from __future__ import annotations

import math

import pytest

from slime_async.config import build_parser, validate


def _cfg(*argv: str):
    return validate(build_parser().parse_args(list(argv)))


def test_defaults_are_the_embedded_async_run():
    cfg = _cfg()
    assert cfg.model.is_moe and cfg.rollout.prompt_data is None
    assert cfg.rollout.global_batch_size == 64 and cfg.rollout.groups_per_step == 8
    assert cfg.data_worker.max_staleness == 2 and cfg.data_worker.fifo_window == 16
    # snapshots cover the worst-case staleness S + ceil((W - 1) / B) = 2 + 2, plus the current one
    assert cfg.trainer.max_snapshots == 5
    assert set(cfg.trainer_cores).isdisjoint(cfg.rollout_cores)


def test_slime_names_map_onto_component_configs():
    cfg = _cfg("--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
               "--num-steps-per-rollout", "2", "--num-rollout", "3", "--eps-clip", "0.1",
               "--eps-clip-high", "0.28", "--use-rollout-routing-replay", "--keep-old-actor",
               "--staleness-correction-method", "icepop", "--staleness-correction-low", "0.5",
               "--staleness-correction-high", "5", "--fifo-window", "inf",
               "--max-off-policy-steps", "3")  # fmt: skip
    assert cfg.rollout.global_batch_size == 8 and cfg.num_steps == 6
    loss = cfg.trainer.loss.config
    assert loss.eps_clip_high == 0.28 and cfg.trainer.routing_replay.value == "r3"
    assert str(loss.staleness_method) == "icepop"
    assert math.isinf(cfg.data_worker.fifo_window)
    assert cfg.data_worker.max_off_policy_steps == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--global-batch-size", "60"], "must be a multiple of --n-samples-per-prompt"),
        (["--rollout-batch-size", "3", "--num-steps-per-rollout", "5"], "not divisible"),
        (["--num-steps", "5", "--num-rollout", "2"], "either --num-steps or --num-rollout"),
        (["--max-staleness", "-1"], "--max-staleness must be >= 0"),
        (["--max-off-policy-steps", "1"], "groups the budget admits would be dropped"),
        (["--update-weights-interval", "3", "--max-staleness", "1"], "needs --max-staleness >= 2"),
        (["--eps-clip-c", "0.5"], "dual clip"),
        (["--colocate", "--trainer-cores", "0"], "--colocate shares all cores"),
        (["--trainer-cores", "0,1", "--rollout-cores", "1"], "overlap"),
        (["--fifo-window", "0"], "fifo_window .W. must be >= 1"),
        (["--keep-old-actor", "--fifo-window", "inf"], "no staleness bound"),
    ],
)
def test_contradictory_flags_fail_with_an_actionable_message(argv, message):
    with pytest.raises(ValueError, match=message):
        _cfg(*argv)


def test_parse_config_exits_with_the_message(capsys):
    from slime_async.config import parse_config

    with pytest.raises(SystemExit):
        parse_config(["--num-engines", "0"])
    assert "--num-engines must be >= 1" in capsys.readouterr().err


def test_embedded_default_turns_on_compis_snapshots_and_r3_but_user_runs_do_not(tmp_path):
    cfg = _cfg()
    assert cfg.trainer.keep_old_actor and cfg.trainer.routing_replay.value == "r3"
    off = _cfg("--no-keep-old-actor", "--routing-replay", "none")
    assert not off.trainer.keep_old_actor and off.trainer.routing_replay.value == "none"
    from transformers import AutoModelForCausalLM

    from slime_async.contracts.model import ModelSpec

    AutoModelForCausalLM.from_config(ModelSpec(family="llama").to_hf_config()).save_pretrained(
        tmp_path / "dense"
    )
    user = _cfg("--hf-checkpoint", str(tmp_path / "dense"))
    assert not user.trainer.keep_old_actor and user.trainer.routing_replay.value == "none"
    with pytest.raises(ValueError, match="needs an MoE model"):
        _cfg("--hf-checkpoint", str(tmp_path / "dense"), "--use-rollout-routing-replay")
