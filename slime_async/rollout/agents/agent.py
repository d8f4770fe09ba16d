"""Agent rollouts (`--agent-function-path module:fn`): ordinary OpenAI-client code runs one
episode per sample against the training gateway, which turns it into one exact trajectory.

Owns `AgentSample` (what the agent gets about its sample), `AgentStats`, `AgentGenerate` (the
data worker's `generate` for an agent: one episode per call, concurrently, each with a
timeout) and `load_agent_function`.

The contract: ``def fn(client: openai.OpenAI, sample: AgentSample) -> float | dict | None``
(or ``async def`` with an `openai.AsyncOpenAI`). The client's `base_url` is the episode's
gateway URL and its `api_key` the gateway's key (the run's data-plane key, never its admin
key); `model` may be anything. Whatever the agent
sends, the run's sampling settings apply (`rollout.gateway`). The reward of the episode is, in
order: what was posted to `<base_url>/../reward`, the function's return value (a number or
`{"reward": x}`), else the run's reward function on the trajectory. An agent that raises or
runs past `--agent-timeout` fails its episode: counted (`agent/failed`, `agent/timed_out`),
the sample masked out of the loss, the run goes on.
Never imports the trainer, engine or controller.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from loss.named import load_function
from slime_async.contracts.rollout import (
    FinishStatus,
    GenerationRequest,
    GenerationResult,
    SegmentPayload,
)
from slime_async.rollout.agents.episode import Episode
from slime_async.rollout.agents.gateway import TrainingGateway
from slime_async.rollout.data.rewards import RewardStatus
from slime_async.rollout.generate.client import GenerateClient

log = logging.getLogger(__name__)
_LOGGED_FAILURES = 5


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AgentSample:
    """One sample as the agent sees it."""

    prompt: str
    """The data prompt as text (the tokenizer's decoding; ids as text without a tokenizer)."""
    messages: list[dict[str, Any]]
    """The prompt as a conversation: `[{"role": "user", "content": prompt}]` unless the data
    carries `metadata.messages`. Sending these first keeps the episode trainable."""
    prompt_ids: tuple[int, ...]
    label: Any
    """The data's label (the answer), if any."""
    metadata: dict[str, Any]
    key: str
    """The prompt's key (stable across the samples of a group)."""
    index: int
    """The sample's index in its group."""
    reward_url: str = ""
    """Where the agent may `POST {"reward": x}` for its episode (with the same bearer token)."""


@dataclasses.dataclass(slots=True)
class AgentStats:
    """Episode outcomes (logged as `agent/*`)."""

    episodes: int = 0
    finished: int = 0
    failed: int = 0
    """The agent raised, or its episode could not be trained (e.g. no model call)."""
    timed_out: int = 0


def load_agent_function(path: str) -> Callable[..., Any]:
    """The agent function at a dotted path (`pkg.mod:fn`), checked to take (client, sample)."""
    fn = load_function(path)
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(params) != 2:
        raise ValueError(
            f"--agent-function-path {path}: the agent function takes (client, sample), "
            f"got {len(params)} required parameters"
        )
    return fn


def _reward_of(value: Any) -> float | None:
    if isinstance(value, dict):
        value = value.get("reward")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"the agent returned reward {value!r}; return a finite number or None")
    return float(value)


def failed_result(prompt_len: int) -> GenerationResult:
    """An empty, masked result for a failed episode (reward status `agent_failed`)."""
    payload = SegmentPayload(logprobs=[], nonfinite=[], finish="abort", prompt_len=prompt_len)
    payload["reward"] = 0.0
    payload["reward_status"] = str(RewardStatus.AGENT_FAILED)
    return GenerationResult(
        output_ids=[], token_versions=[], status=FinishStatus.FINISHED, payload=payload
    )


class AgentGenerate:
    """The data worker's `generate` for an agent function (see the module docstring)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        client: GenerateClient,
        gateway: TrainingGateway,
        *,
        timeout_s: float,
        decode: Callable[[Sequence[int]], str],
        max_turn_tokens: int | None = None,
        max_concurrency: int = 64,
    ) -> None:
        self.fn, self.client, self.gateway = fn, client, gateway
        self.timeout_s, self.decode = timeout_s, decode
        self.max_turn_tokens = max_turn_tokens
        self.is_async = inspect.iscoroutinefunction(fn)
        self.stats = AgentStats()
        self._pool = (
            None
            if self.is_async
            else concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="agent")
        )

    def metrics(self) -> dict[str, float]:
        """Cumulative `agent/*` counters: episodes and how they ended, the gateway's turns,
        prefix mismatches (sampled ids kept), sampling overrides, turns resumed after a push,
        calls refused with a 4xx (the gateway's or the engine's)."""
        g = self.gateway.stats
        return {
            "agent/episodes": self.stats.episodes,
            "agent/finished": self.stats.finished,
            "agent/failed": self.stats.failed,
            "agent/timed_out": self.stats.timed_out,
            "agent/turns": g.turns,
            "agent/prefix_mismatches": g.prefix_mismatches,
            "agent/sampling_overrides": g.sampling_overrides,
            "agent/resumed_turns": g.resumed_turns,
            "agent/resumed_calls": g.resumed_calls,
            "agent/bad_calls": g.bad_calls,
        }

    async def close(self) -> None:
        await self.client.close()
        await self.gateway.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def sample_of(self, req: GenerationRequest, *, reward_url: str = "") -> AgentSample:
        p = req.prompt
        text = self.decode(list(p.prompt_ids))
        meta = dict(p.payload.get("metadata") or {})
        msgs = meta.get("messages")
        return AgentSample(
            prompt=text,
            messages=list(msgs) if isinstance(msgs, list) else [{"role": "user", "content": text}],
            prompt_ids=tuple(p.prompt_ids),
            label=p.payload.get("label"),
            metadata=meta,
            key=p.key,
            index=req.sample_index,
            reward_url=reward_url,
        )

    def _run_sync(self, url: str, sample: AgentSample) -> Any:
        import openai

        token = self.gateway.api_key
        with openai.OpenAI(
            base_url=url, api_key=token, max_retries=0, timeout=self.timeout_s
        ) as client:
            return self.fn(client, sample)

    async def _run_async(self, url: str, sample: AgentSample) -> Any:
        import openai

        token = self.gateway.api_key
        async with openai.AsyncOpenAI(
            base_url=url, api_key=token, max_retries=0, timeout=self.timeout_s
        ) as client:
            return await self.fn(client, sample)

    async def episode(self, req: GenerationRequest) -> tuple[Episode, Any]:
        """Run one episode; returns it and the agent's return value (raises what the agent
        raised, `TimeoutError` past the timeout)."""
        await self.gateway.start()
        ep = self.gateway.open_episode(
            self.client, data_prompt=req.prompt.prompt_ids, max_turn_tokens=self.max_turn_tokens
        )
        url = self.gateway.episode_url(ep)
        sample = self.sample_of(req, reward_url=self.gateway.reward_url(ep))
        try:
            if self.is_async:
                run = self._run_async(url, sample)
            else:
                loop = asyncio.get_running_loop()
                run = loop.run_in_executor(self._pool, self._run_sync, url, sample)
            ret = await asyncio.wait_for(run, self.timeout_s)
        finally:
            self.gateway.close_episode(ep)  # a timed-out agent's later calls get 404
        return ep, ret

    async def __call__(
        self, req: GenerationRequest, priority: float, expected_len: int
    ) -> GenerationResult:
        del priority, expected_len
        self.stats.episodes += 1
        try:
            ep, ret = await self.episode(req)
            res = ep.trajectory()
            reward = ep.reward if ep.reward is not None else _reward_of(ret)
        except (TimeoutError, asyncio.TimeoutError):
            self.stats.timed_out += 1
            return self._failed(req, f"ran past --agent-timeout {self.timeout_s:g}s")
        except Exception as e:  # the agent's own error fails its episode, not the run
            self.stats.failed += 1
            return self._failed(req, f"{type(e).__name__}: {e}")
        self.stats.finished += 1
        if reward is not None:
            pay = dict(res.payload)
            pay.update(reward=reward, reward_status=str(RewardStatus.OK))
            res = dataclasses.replace(res, payload=pay)
        return res

    def _failed(self, req: GenerationRequest, why: str) -> GenerationResult:
        n = self.stats.failed + self.stats.timed_out
        if n <= _LOGGED_FAILURES:
            log.warning(
                "agent episode of %s/%d failed (masked): %s%s",
                req.prompt.key,
                req.sample_index,
                why,
                "" if n < _LOGGED_FAILURES else " (further failures are only counted)",
            )
        return failed_result(len(req.prompt.prompt_ids))
