"""A reward model behind HTTP: slime's `--rm-url` (its `remote_rm`), with a timeout, retries and
an error that names the server, the sample and the fix.

Owns `RemoteReward` (a reward function, `fn(RewardInput) -> float`, that POSTs each finished
sample to the server) and `RemoteRewardError`. The wire is slime's: the body is the JSON object
``{"prompt": text, "response": text, "label": label}`` (text decoded with the run's tokenizer;
a run without one sends the token ids as decimal text), the answer a JSON number or an object
holding the reward under `reward_key` (slime's `--reward-key`; default ``"reward"``). Each
call may take `timeout_s`; a call that times out, cannot connect or gets HTTP 429 or 5xx is
tried again, up to `retries` more times with a growing pause; any other answer (HTTP 4xx, a body
that is not a reward) is an error at once, since asking again cannot change it. The error
propagates to the scorer, which stops the run naming the function and the sample (a masked
sample would hide a dead reward model). `slime_async/examples/reward_server.py` is a server to
start from. Never imports the trainer, engine or controller.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import aiohttp

from slime_async.rollout.data.rewards import RewardInput

RETRY_PAUSE_S = 0.5
"""The pause before the first retry; it doubles with each one, up to `MAX_PAUSE_S`."""
MAX_PAUSE_S = 8.0


class RemoteRewardError(RuntimeError):
    """The reward model gave no reward for a sample (the message names the server and the fix)."""


class _Retry(Exception):
    """An attempt worth repeating (timeout, connection refused, HTTP 429/5xx)."""


class RemoteReward:
    """`--rm-url URL`: score a sample by POSTing it to the reward model at `url`.

    Example (the example server, on a math row whose label is "5")::

        rm = RemoteReward("http://127.0.0.1:8000", timeout_s=30, retries=3)
        await rm(RewardInput(response_ids=..., response_text="... so 5", label="5"))  # 1.0
    """

    def __init__(
        self, url: str, *, timeout_s: float, retries: int, reward_key: str | None = None
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--rm-url {url!r}: give the reward model's http(s):// URL")
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self.reward_key = reward_key or "reward"

    def __repr__(self) -> str:
        return f"RemoteReward({self.url})"

    async def __call__(self, inp: RewardInput) -> float:
        body = {
            "prompt": _text(inp.prompt_text, inp.prompt_ids),
            "response": _text(inp.response_text, inp.response_ids),
            "label": inp.label,
        }
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(MAX_PAUSE_S, RETRY_PAUSE_S * 2 ** (attempt - 1)))
            try:
                return self._reward(await self._post(body), inp)
            except _Retry as e:
                last = str(e)
        raise RemoteRewardError(
            f"the reward model at {self.url} gave no reward for {inp.describe()} after "
            f"{self.retries + 1} tries (last: {last}); check that it runs and answers POST "
            "{prompt, response, label} (slime_async/examples/reward_server.py is one), or raise "
            "--rm-timeout / --rm-retries"
        )

    async def _post(self, body: dict[str, Any]) -> Any:
        """One attempt: the answer's JSON; `_Retry` for what another attempt may fix."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(self.url, json=body) as resp,
            ):
                text = await resp.text()
                if resp.status == 429 or resp.status >= 500:
                    raise _Retry(f"HTTP {resp.status}: {text[:200]}")
                if resp.status >= 400:
                    raise RemoteRewardError(
                        f"the reward model at {self.url} refused the request: HTTP "
                        f"{resp.status}: {text[:200]}; it must take POST "
                        "{prompt, response, label} as JSON"
                    )
        except (TimeoutError, asyncio.TimeoutError):
            raise _Retry(f"no answer within --rm-timeout {self.timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise _Retry(f"{type(e).__name__}: {e}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise RemoteRewardError(
                f"the reward model at {self.url} answered {text[:200]!r}, not JSON; it must "
                f"answer a number or an object with {self.reward_key!r}"
            ) from None

    def _reward(self, answer: Any, inp: RewardInput) -> float:
        """The reward in `answer`: a number, or the number under `reward_key`."""
        value = answer.get(self.reward_key) if isinstance(answer, dict) else answer
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise RemoteRewardError(
                f"the reward model at {self.url} answered {json.dumps(answer)[:200]} for "
                f"{inp.describe()}: not a finite number, nor an object holding one under "
                f"{self.reward_key!r} (set --reward-key to the key it uses)"
            )
        return float(value)


def _text(text: str | None, ids: Any) -> str:
    """Decoded text, or the ids as decimal text in a run without a tokenizer."""
    return text if text is not None else " ".join(str(int(t)) for t in ids)
