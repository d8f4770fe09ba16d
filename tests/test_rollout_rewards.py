"""Rewards: exact match, math-verify, failure masking and counting, plugin resolution."""

from __future__ import annotations

import asyncio
import math
import sys
import threading

import pytest

from slime_async.rollout.data.rewards import (
    RewardInput,
    RewardResult,
    RewardStatus,
    compute_reward,
    compute_reward_sync,
    exact_match,
    exact_match_reward,
    load_reward_fn,
    math_verify_reward,
    summarize_rewards,
)
from slime_async.rollout.data.tasks import EOS, TaskKind, make_prompt


def _inp(response_ids, label, **kw) -> RewardInput:
    return RewardInput(response_ids=response_ids, label=label, **kw)


def test_exact_match_reward_on_task_prompts() -> None:
    p = make_prompt(TaskKind.SORT, "9310", level=0)
    good = list(p.response_ids)
    assert exact_match_reward(_inp(good, p.label_ids)) == 1.0
    assert exact_match_reward(_inp(good[:-1], p.label_ids)) == 0.0  # no EOS (truncated)
    assert exact_match_reward(_inp([*good, EOS], p.label_ids)) == 0.0  # junk after EOS
    bad = list(good)
    bad[1] += 1
    assert exact_match_reward(_inp(bad, p.label_ids)) == 0.0
    assert exact_match_reward(_inp(good, p.label)) == 1.0  # label given as digit string
    assert exact_match([], []) is False


class _Boom(RuntimeError):
    pass


def _raises(inp: RewardInput) -> float:
    raise _Boom("grader crashed")


@pytest.mark.parametrize(
    ("fn", "status", "error_part"),
    [
        (_raises, RewardStatus.ERROR, "_Boom: grader crashed"),
        (lambda inp: math.nan, RewardStatus.NON_FINITE, "nan"),
        (lambda inp: -math.inf, RewardStatus.NON_FINITE, "inf"),
        (lambda inp: "1.0x", RewardStatus.NON_FINITE, "str"),
        (lambda inp: None, RewardStatus.NON_FINITE, "NoneType"),
    ],
)
async def test_failing_rewards_are_masked_not_raised(fn, status, error_part) -> None:
    res = await compute_reward(fn, _inp([EOS], ()))
    assert res.status is status and res.masked
    assert res.reward == 0.0
    assert error_part in res.error
    sync = compute_reward_sync(fn, _inp([EOS], ()))
    assert sync == res


async def test_async_and_bool_rewards() -> None:
    async def graded(inp: RewardInput) -> bool:
        await asyncio.sleep(0)
        return len(inp.response_ids) == 2

    assert await compute_reward(graded, _inp([1, EOS], ())) == RewardResult(reward=1.0)
    assert (await compute_reward(graded, _inp([EOS], ()))).reward == 0.0
    res = compute_reward_sync(graded, _inp([EOS], ()))  # async fn through the sync door
    assert res.status is RewardStatus.ERROR and "use compute_reward" in res.error


def test_summarize_counts_masked_samples() -> None:
    results = [
        RewardResult(reward=1.0),
        RewardResult(reward=0.0),
        RewardResult(reward=0.0, status=RewardStatus.ERROR, error="x"),
        RewardResult(reward=0.0, status=RewardStatus.NON_FINITE, error="nan"),
    ]
    m = summarize_rewards(results)
    assert m["rollout/reward"] == 0.5  # masked samples do not drag the mean
    assert m["reward/error_count"] == 1 and m["reward/non_finite_count"] == 1
    assert m["reward/masked_frac"] == 0.5 and m["reward/count"] == 4
    assert math.isnan(summarize_rewards(results[2:])["rollout/reward"])


def test_load_reward_fn_by_name_and_dotted_path() -> None:
    assert load_reward_fn("exact_match") is exact_match_reward
    assert load_reward_fn("math_verify") is math_verify_reward
    assert (
        load_reward_fn("slime_async.rollout.data.rewards:exact_match_reward") is exact_match_reward
    )
    assert (
        load_reward_fn("slime_async.rollout.data.rewards.exact_match_reward") is exact_match_reward
    )
    with pytest.raises(ImportError, match=r"cannot import module 'no_such_pkg_xyz\.mod'"):
        load_reward_fn("no_such_pkg_xyz.mod:fn")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        load_reward_fn("slime_async.rollout.data.rewards:missing")
    with pytest.raises(ValueError, match="dotted path"):
        load_reward_fn("exactmatch")


math_verify = pytest.importorskip("math_verify")


@pytest.mark.parametrize(
    ("label", "text", "reward"),
    [
        ("1/2", "so the answer is \\boxed{0.5}", 1.0),
        ("\\frac{1}{2}", "The answer is $\\frac{2}{4}$", 1.0),
        ("42", "I think it is 41.", 0.0),
        ("x^2", "\\boxed{x \\cdot x}", 1.0),
    ],
)
def test_math_verify_reward(label: str, text: str, reward: float) -> None:
    res = compute_reward_sync(math_verify_reward, _inp([], label, response_text=text))
    assert res == RewardResult(reward=reward)


def test_math_verify_off_main_thread_and_without_text() -> None:
    out: list[RewardResult] = []
    inp = _inp([], "3", response_text="\\boxed{3}")
    t = threading.Thread(target=lambda: out.append(compute_reward_sync(math_verify_reward, inp)))
    t.start()
    t.join(timeout=60)
    assert out == [RewardResult(reward=1.0)]  # SIGALRM timeouts are skipped off the main thread
    res = compute_reward_sync(math_verify_reward, _inp([], "3"))
    assert res.masked and "needs response_text" in res.error


def test_math_verify_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # what an uninstalled package looks like
    with pytest.raises(ImportError, match="pip install math-verify"):
        math_verify_reward(_inp([], "1", response_text="1"))
