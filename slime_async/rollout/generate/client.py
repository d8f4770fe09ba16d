"""The rollout generate client: one data-worker sample -> one SGLang `/generate` call.

Owns `GenerateClientConfig` and `GenerateClient`, the async callable the RolloutDataWorker is
given. It builds SGLang's request (token ids in, log-probs and routed experts requested), sends
it through the router with the `X-Expected-Tokens` hint, and turns the response into a
`GenerationResult`: new tokens, per-token policy versions (from `meta_info.weight_versions`
spans when the engine reports them, else `meta_info.weight_version`), finish status, and a
payload with log-probs, routed experts and a count of non-finite log-probs. Rewards are not
computed here (the controller scores finished samples). Never imports the trainer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from typing import Any

import aiohttp
import numpy as np

from slime_async.contracts.rollout import (
    FinishStatus,
    GenerationRequest,
    GenerationResult,
    SegmentPayload,
    decode_routed_experts,
)
from slime_async.contracts.vision import data_uri


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GenerateClientConfig:
    """How rollouts are sampled and where the requests go."""

    url: str
    """Router (or single engine) base URL."""
    max_response_len: int = 64
    """Most new tokens per sample (a continued rollout gets what is left of it)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling (-1: whole vocabulary)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the model's EOS."""
    stop: tuple[str, ...] = ()
    """Stop strings (matched by the engine on decoded text)."""
    return_routed_experts: bool = False
    """Ask the engine for MoE routing (needed for rollout routing replay, R3)."""
    timeout_s: float = 600.0
    """Per-request timeout."""
    max_connection_retries: int = 20
    """Connection-level retries (the router itself retries on engines); waits 0.5 s each."""
    lora_name: str | None = None
    """A LoRA run's adapter: every request is served under it (`lora_path`), and a body that
    names no adapter is refused here rather than silently served by the base model."""
    api_key: str | None = dataclasses.field(default=None, repr=False)
    """The run's data-plane key, sent as `Authorization: Bearer` (a router or engine with keys
    requires it on /generate); never the admin key."""
    image_token_id: int | None = None
    """A vision-language model's `<|image_pad|>`: a prompt with images is sent in SGLang's form,
    each image's placeholder run collapsed to one pad (SGLang's processor expands it again from
    the image; so does the embedded engine), the images themselves in `image_data`."""


class GenerateError(RuntimeError):
    """The engine answered with an error the client cannot recover from; `status` is the HTTP
    status of a refusal (4xx: the request's fault), None when no engine answered in time or
    every answer was a 5xx (an engine that is down)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _version(raw: Any) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise GenerateError(
            f"engine reports weight_version {raw!r}, not a trainer version; start engines with "
            "--weight-version 0 (train_async does) so every sample can be tagged"
        ) from None


def token_versions(meta: dict[str, Any], n_tokens: int) -> list[int]:
    """Per-output-token versions from `weight_versions` spans, else the single `weight_version`."""
    out = [_version(meta.get("weight_version", 0))] * n_tokens
    for span in meta.get("weight_versions") or ():
        v = _version(span["version"])
        for t in range(max(0, int(span["start"])), min(n_tokens, int(span["end"]))):
            out[t] = v
    return out


def one_pad_per_image(ids: list[int], pad: int) -> list[int]:
    """`ids` with every run of `pad` tokens collapsed to one (SGLang's `/generate` form of a
    prompt with images: its processor expands each pad to the image's token count)."""
    return [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]


class GenerateClient:
    """`await client(request, priority, expected_len) -> GenerationResult` over HTTP."""

    def __init__(self, cfg: GenerateClientConfig, *, num_layers: int = 0, topk: int = 0) -> None:
        self.cfg = cfg
        self.num_layers, self.topk = num_layers, topk
        self._session: aiohttp.ClientSession | None = None
        self.nonfinite_logprobs = 0
        """Tokens whose engine log-prob was NaN/inf (masked from the loss, counted)."""

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _s(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            token = self.cfg.api_key
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s),
                headers={"Authorization": f"Bearer {token}"} if token else None,
            )
        return self._session

    def build_request(self, req: GenerationRequest) -> dict[str, Any]:
        """SGLang `/generate` body for one sample (a continuation resends prompt + prefix)."""
        cfg = self.cfg
        budget = cfg.max_response_len - len(req.prefix_ids)
        sampling: dict[str, Any] = {
            "max_new_tokens": max(1, budget),
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
        }
        if cfg.stop_token_ids:
            sampling["stop_token_ids"] = list(cfg.stop_token_ids)
        if cfg.stop:
            sampling["stop"] = list(cfg.stop)
        refs = req.prompt.payload.get("images")
        ids = list(req.prompt.prompt_ids)
        if refs and cfg.image_token_id is not None:
            ids = one_pad_per_image(ids, cfg.image_token_id)
        body: dict[str, Any] = {
            "input_ids": [*ids, *req.prefix_ids],
            "sampling_params": sampling,
            "return_logprob": True,
            "rid": f"{req.prompt.key}-g{req.group_seq}-s{req.sample_index}-a{req.attempt}",
        }
        if cfg.return_routed_experts:
            body["return_routed_experts"] = True
        if refs:  # the engine takes the images themselves (data URIs), never a path
            body["image_data"] = [data_uri(r) for r in refs]
        if cfg.lora_name is not None:
            body["lora_path"] = cfg.lora_name
        return body

    async def __call__(
        self, req: GenerationRequest, priority: float, expected_len: int
    ) -> GenerationResult:
        del priority  # ordering is the data worker's job; the router balances on expected_len
        body = self.build_request(req)
        # expected_len already counts the prompt's image tokens (the data worker's extra_work)
        headers = {
            "X-Expected-Tokens": str(max(1, int(expected_len))),
            # the router keeps a group's samples on the engine that caches their prompt
            "X-Group-Key": f"{req.prompt.key}-g{req.group_seq}",
        }
        data = await self.post(body, headers)
        # the trained prompt is the expanded one (a collapsed body is shorter)
        prompt_len = len(req.prompt.prompt_ids) + len(req.prefix_ids)
        return self.parse_response(data, prompt_len=prompt_len)

    async def post(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """POST `/generate` with connection-level retries; the parsed JSON answer. In a LoRA
        run a body that does not name the run's adapter is refused (GenerateError)."""
        if self.cfg.lora_name is not None and body.get("lora_path") != self.cfg.lora_name:
            raise GenerateError(
                f"this is a LoRA run: /generate must name the adapter (lora_path "
                f"{self.cfg.lora_name!r}), got {body.get('lora_path')!r}; the engine would "
                "serve the base model"
            )
        last: Exception | None = None
        for _ in range(self.cfg.max_connection_retries + 1):
            try:
                async with self._s().post(
                    f"{self.cfg.url.rstrip('/')}/generate", json=body, headers=headers
                ) as resp:
                    text = await resp.text()
                    if resp.status >= 500 or resp.status == 429:
                        last = GenerateError(f"/generate HTTP {resp.status}: {text[:300]}")
                    elif resp.status != 200:
                        raise GenerateError(
                            f"/generate HTTP {resp.status}: {text[:300]}", status=resp.status
                        )
                    else:
                        return json.loads(text)
            except (TimeoutError, asyncio.TimeoutError, aiohttp.ClientConnectionError) as e:
                last = e
            await asyncio.sleep(0.5)
        raise GenerateError(f"/generate failed after retries: {last}")

    def parse_response(self, data: dict[str, Any], *, prompt_len: int) -> GenerationResult:
        """SGLang response -> `GenerationResult` (its payload a `SegmentPayload`)."""
        if isinstance(data, list):
            raise GenerateError("batch response to a single request")
        meta = data.get("meta_info") or {}
        entries = meta.get("output_token_logprobs") or []
        output_ids = [int(e[1]) for e in entries] if entries else list(data.get("output_ids", []))
        logprobs: list[float] = []
        bad: list[bool] = []
        for e in entries:
            lp = e[0]
            ok = lp is not None and math.isfinite(float(lp))
            bad.append(not ok)
            logprobs.append(float(lp) if ok else 0.0)
        if len(logprobs) != len(output_ids):
            raise GenerateError(
                f"engine returned {len(output_ids)} tokens but {len(logprobs)} log-probs; "
                "request return_logprob=true"
            )
        self.nonfinite_logprobs += sum(bad)
        finish = meta.get("finish_reason") or {}
        status = (
            FinishStatus.ABORTED
            if isinstance(finish, dict) and finish.get("type") == "abort"
            else FinishStatus.FINISHED
        )
        payload = SegmentPayload(
            logprobs=logprobs,
            nonfinite=bad,
            finish=(finish or {}).get("type") if isinstance(finish, dict) else None,
            prompt_len=prompt_len,
        )
        routed = meta.get("routed_experts")
        if routed and self.cfg.return_routed_experts:
            try:
                experts = decode_routed_experts(routed, num_layers=self.num_layers, topk=self.topk)
            except ValueError as e:
                raise GenerateError(f"{e}: engine and trainer disagree on the model") from e
            payload["routed_experts"] = experts.astype(np.int32)
        return GenerationResult(
            output_ids=output_ids,
            token_versions=token_versions(meta, len(output_ids)),
            status=status,
            payload=payload,
        )


async def check_routed_experts(
    url: str, *, timeout_s: float = 60.0, token: str | None = None
) -> None:
    """Ask `url` for one token with `return_routed_experts`; raise `GenerateError` naming the
    fix unless `meta_info.routed_experts` comes back. Rollout routing replay (R3) needs them on
    every sample; the stock sglang-router re-serialises requests and drops the field, so an
    `--engine-urls` entry pointing at one would otherwise fail only at the first train step."""
    body = {
        "input_ids": [1],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_routed_experts": True,
    }
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s,
            s.post(
                f"{url.rstrip('/')}/generate",
                json=body,
                headers={"Authorization": f"Bearer {token}"} if token else None,
            ) as r,
        ):
            text = await r.text()
            data = json.loads(text) if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError, ValueError) as e:
        raise GenerateError(f"routing-replay probe of {url} failed: {e}") from e
    if data is None:
        raise GenerateError(
            f"routing-replay probe of {url}: /generate HTTP {r.status}: {text[:200]}"
        )
    item = data[0] if isinstance(data, list) and data else data
    if not (item.get("meta_info") or {}).get("routed_experts"):
        raise GenerateError(
            f"{url} answered /generate without meta_info.routed_experts although the request "
            "asked for them, so rollout routing replay (--routing-replay r3) would have no "
            "engine routing to replay. The stock sglang-router drops return_routed_experts: "
            "point --engine-urls at the engines themselves, or start them so that they always "
            "return routing (ours: --always-return-routed-experts; SGLang: "
            "--enable-return-routed-experts behind a router that forwards the field), or use "
            "--routing-replay r2 or none"
        )
