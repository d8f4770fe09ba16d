"""Embedded task family: token layout, determinism, split, difficulty distribution."""

from __future__ import annotations

import collections

import pytest

from slime_async.contracts.model import TINY_MOE, ModelSpec
from slime_async.rollout.data.tasks import (
    BOS,
    EOS,
    PAD,
    SEP,
    TASK_VOCAB_SIZE,
    TaskFamily,
    TaskFamilyConfig,
    TaskKind,
    decode,
    level_probs,
    make_prompt,
    solve,
    task_hf_config,
)


@pytest.mark.parametrize(
    ("kind", "digits", "answer"),
    [
        (TaskKind.COPY, "307", "307"),
        (TaskKind.REVERSE, "3071", "1703"),
        (TaskKind.SORT, "93107", "01379"),
        (TaskKind.ADD_ONE, "0099", "0100"),
        (TaskKind.ADD_ONE, "999", "1000"),
        (TaskKind.ADD_ONE, "41", "42"),
    ],
)
def test_solve(kind: TaskKind, digits: str, answer: str) -> None:
    assert solve(kind, digits) == answer


def test_solve_rejects_non_digits() -> None:
    with pytest.raises(ValueError, match="0-9"):
        solve(TaskKind.COPY, "12a")


def test_prompt_layout_and_decode() -> None:
    p = make_prompt(TaskKind.REVERSE, "31", level=0)
    assert p.prompt_ids[0] == BOS and p.prompt_ids[-1] == SEP
    assert p.prompt_ids[1] == TaskKind.REVERSE.token
    assert p.response_ids == (*p.label_ids, EOS)
    assert p.expected_len == 3
    assert p.key == "reverse/31"
    assert decode(p.prompt_ids) == "<bos> reverse 3 1 <sep>"
    assert decode(p.response_ids) == "1 3 <eos>"
    all_ids = {t for k in TaskKind for t in make_prompt(k, "0123456789", level=0).prompt_ids}
    assert max(all_ids) < TASK_VOCAB_SIZE <= TINY_MOE.vocab_size
    assert PAD not in all_ids


def test_hf_config_gets_special_ids_and_small_vocab_is_rejected() -> None:
    cfg = task_hf_config(TINY_MOE)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (BOS, EOS, PAD)
    with pytest.raises(ValueError, match="vocab_size >= 20"):
        task_hf_config(ModelSpec(vocab_size=16))


def test_generation_is_deterministic_per_seed_and_index() -> None:
    a, b = TaskFamily(TaskFamilyConfig(seed=3)), TaskFamily(TaskFamilyConfig(seed=3))
    assert a.train_prompts(0, 50) == b.train_prompts(0, 50)
    assert a.train_prompt(17) == b.train_prompts(10, 10)[7]  # random access == streaming
    c = TaskFamily(TaskFamilyConfig(seed=4))
    assert [p.key for p in a.train_prompts(0, 50)] != [p.key for p in c.train_prompts(0, 50)]
    assert a.eval_set() == b.eval_set()


def test_train_and_eval_splits_are_disjoint() -> None:
    fam = TaskFamily(TaskFamilyConfig(seed=0, eval_per_level=8))
    ev = fam.eval_set()
    keys = [p.key for p in ev]
    assert len(keys) == len(set(keys)) == 8 * fam.config.num_levels
    assert all(fam.is_eval_key(k) for k in keys)
    train = fam.train_prompts(0, 3000)
    assert not {p.key for p in train} & set(keys)
    assert not any(fam.is_eval_key(p.key) for p in train)
    assert collections.Counter(p.level for p in ev) == {lv: 8 for lv in range(4)}


def test_hard_prompts_are_rarer_but_longer() -> None:
    fam = TaskFamily(TaskFamilyConfig(seed=1))
    prompts = fam.train_prompts(0, 4000)
    counts = collections.Counter(p.level for p in prompts)
    assert [counts[lv] for lv in range(4)] == sorted((counts[lv] for lv in range(4)), reverse=True)
    probs = level_probs(fam.config)
    for lv in range(4):  # empirical frequency close to the configured one
        assert abs(counts[lv] / 4000 - probs[lv]) < 0.03
    mean_len = {
        lv: sum(p.expected_len for p in prompts if p.level == lv) / counts[lv] for lv in range(4)
    }
    assert mean_len[0] < mean_len[1] < mean_len[2] < mean_len[3]
    assert {len(p.digits) for p in prompts if p.level == 3} == {11}
    assert {p.kind for p in prompts} == set(TaskKind)


def test_eval_set_too_large_for_level_space_names_the_fix() -> None:
    fam = TaskFamily(TaskFamilyConfig(min_digits=1, digits_per_level=1, num_levels=1))
    with pytest.raises(ValueError, match="lower eval_per_level"):
        fam.eval_set(50)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tasks": ()}, "empty"),
        ({"num_levels": 0}, "num_levels"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"level_decay": 0.0}, "level_decay"),
        ({"tasks": ("nope",)}, "nope"),
    ],
)
def test_bad_config_is_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TaskFamilyConfig(**kwargs)
