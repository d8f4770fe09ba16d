"""`--rm-url`: a reward model behind HTTP (slime's `remote_rm` wire), against the example server
(`slime_async/examples/reward_server.py`, a real process) and servers that time out, fail and
come back, or answer nonsense; a dead reward model stops the run naming the server, the sample
and the fix."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from aiohttp import web

from slime_async.config.cli import build_parser
from slime_async.rollout.config import rollout_config_from_args
from slime_async.rollout.data.plan import make_data_plan
from slime_async.rollout.data.remote_rm import RemoteReward, RemoteRewardError
from slime_async.rollout.data.rewards import RewardInput, RewardStatus, compute_reward

pytestmark = pytest.mark.timeout(120)


def _inp(response: str, label="5") -> RewardInput:
    return RewardInput(
        response_ids=[1, 2], response_text=response, prompt_text="What is 2+3?", label=label
    )


@pytest.fixture(scope="module")
def example_server():
    proc = subprocess.Popen(
        [sys.executable, "-m", "slime_async.examples.reward_server", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


async def test_the_example_server_scores_samples(example_server):
    rm = RemoteReward(example_server, timeout_s=10, retries=0)
    assert await rm(_inp("2 plus 3 makes 5")) == 1.0
    assert await rm(_inp("2 plus 3 makes 6")) == 0.0
    assert await rm(_inp("it is Paris.", label="Paris")) == 1.0
    # through the run's reward plumbing: --rm-url becomes the plan's reward function
    cfg = rollout_config_from_args(build_parser().parse_args(["--rm-url", example_server]))
    plan = make_data_plan(cfg, seed=0, hf_checkpoint=None)
    assert isinstance(plan.reward_fn, RemoteReward) and plan.reward_fn.url == example_server
    got = await compute_reward(plan.reward_fn, RewardInput(response_ids=[7, 5], label="5"))
    assert got.status is RewardStatus.OK and got.reward == 1.0  # ids as text without a tokenizer


async def _server(port: int, handler) -> web.AppRunner:
    app = web.Application()
    app.router.add_post("/score", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_timeouts_and_server_errors_are_retried_then_the_reward_comes(unused_tcp_port):
    calls = []

    async def flaky(request: web.Request) -> web.Response:
        calls.append(await request.json())
        if len(calls) == 1:
            await asyncio.sleep(1)  # past the timeout
        if len(calls) == 2:
            return web.Response(status=503, text="warming up")
        return web.json_response({"score": 0.75})

    runner = await _server(unused_tcp_port, flaky)
    try:
        rm = RemoteReward(
            f"http://127.0.0.1:{unused_tcp_port}/score",
            timeout_s=0.5,
            retries=2,
            reward_key="score",
        )
        assert await rm(_inp("five")) == 0.75
    finally:
        await runner.cleanup()
    assert len(calls) == 3
    assert calls[-1] == {"prompt": "What is 2+3?", "response": "five", "label": "5"}  # slime's


async def test_a_dead_or_wrong_reward_model_is_a_clear_error(unused_tcp_port):
    dead = RemoteReward(f"http://127.0.0.1:{unused_tcp_port}", timeout_s=1, retries=1)
    t0 = time.monotonic()
    with pytest.raises(RemoteRewardError) as err:
        await dead(_inp("5"))
    msg = str(err.value)
    assert f"127.0.0.1:{unused_tcp_port}" in msg and "after 2 tries" in msg
    assert "--rm-timeout" in msg and "reward_server.py" in msg and "prompt" in msg
    assert time.monotonic() - t0 < 5

    async def wrong(request: web.Request) -> web.Response:
        if (await request.json())["response"] == "refuse":
            return web.Response(status=422, text="bad body")
        return web.json_response({"value": 1})

    runner = await _server(unused_tcp_port, wrong)
    try:
        rm = RemoteReward(f"http://127.0.0.1:{unused_tcp_port}/score", timeout_s=5, retries=3)
        with pytest.raises(RemoteRewardError, match=r"under 'reward'.*--reward-key"):
            await rm(_inp("5"))
        with pytest.raises(RemoteRewardError, match="HTTP 422: bad body"):
            await rm(_inp("refuse"))  # a 4xx is not retried: asking again cannot change it
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--rm-url", "localhost:8000"], "http"),
        (["--rm-url", "http://x", "--custom-rm-path", "m:f"], "both name the reward"),
        (["--reward-key", "score"], "of an --rm-url reward model or a --custom-rm-path function"),
    ],
)
def test_remote_rm_flags_refuse_what_cannot_work(argv, match):
    with pytest.raises(ValueError, match=match):
        rollout_config_from_args(build_parser().parse_args(argv))


def test_slime_style_plugins_read_the_rm_url_from_args(tmp_path):
    """slime's own rewards read `args.rm_url` (its `remote_rm`, on-policy distillation)."""
    from slime_async.config import parse_config
    from slime_async.orchestrator.generate_chain import slime_plugin_args

    argv = ["--run-dir", str(tmp_path), "--rm-url", "http://127.0.0.1:9/rm", "--reward-key", "r"]
    args = slime_plugin_args(parse_config(argv), "http://127.0.0.1:1")
    assert (args.rm_url, args.reward_key) == ("http://127.0.0.1:9/rm", "r")


async def test_rm_type_remote_rm_is_the_rm_url_model(example_server):
    """slime's `--rm-type remote_rm --rm-url URL`: the same remote reward model; a sample whose
    metadata names another type is scored in-process by that type."""
    from slime_async.rollout.data.slime_rm import SlimeRewards

    rm = SlimeRewards(
        "remote_rm", seed=0, remote=RemoteReward(example_server, timeout_s=10, retries=0)
    )
    assert (await compute_reward(rm, _inp("2 plus 3 makes 5"))).reward == 1.0
    assert (await compute_reward(rm, _inp("2 plus 3 makes 6"))).reward == 0.0
    boxed = RewardInput(
        response_ids=[1], response_text="so \\boxed{5}", label="5", metadata={"rm_type": "math"}
    )
    assert (await compute_reward(rm, boxed)).reward == 1.0


def test_eval_samples_read_the_answer_under_eval_reward_key():
    """slime's `--eval-reward-key` (default `--reward-key`): the key of eval samples' reward."""
    argv = ["--rm-url", "http://127.0.0.1:9/rm", "--reward-key", "score"]
    plan = make_data_plan(
        rollout_config_from_args(build_parser().parse_args([*argv, "--eval-reward-key", "acc"])),
        seed=0,
        hf_checkpoint=None,
    )
    assert (plan.reward_fn.reward_key, plan.eval_reward_fn.reward_key) == ("score", "acc")
    plan = make_data_plan(
        rollout_config_from_args(build_parser().parse_args(argv)), seed=0, hf_checkpoint=None
    )
    assert plan.eval_reward_fn.reward_key == "score"
