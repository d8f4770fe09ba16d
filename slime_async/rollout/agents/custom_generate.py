"""Custom generation (`--custom-generate-function-path`): multi-turn and tool-use rollouts, token in,
token out, under the data worker's scheduling, budget and partial-rollout rules.

Owns: `Trajectory` (a response built of model turns and tool/environment turns, with a loss mask,
per-token log-probs and versions), `GenerateContext` (what a custom function gets: the request,
`model_turn` through the run's router, `add_tool_tokens`, the budget), `CustomGenerate` (the
`generate` callable the data worker is given) and `load_custom_generate`. Never imports the
trainer, engine or controller.

Our contract: ``async def fn(ctx: GenerateContext) -> None`` builds `ctx.trajectory` (one
required parameter). Model tokens come only from `ctx.model_turn` (log-probs, per-token
versions from the engine's `meta_info`, routed experts), tool tokens only from
`ctx.add_tool_tokens` (loss mask 0, log-prob 0, the version of the latest model token). When a
model turn is aborted (a weight update under `--partial-rollout continue`), `fn` returns at once
(`ctx.aborted`); the data worker re-dispatches the sample with everything generated so far, and
`ctx.trajectory` starts from it, so `fn` must pick up where the trajectory ends (see
`slime_async/examples/calculator_tool.py`). Earlier tokens keep their versions.

slime's contract (three required parameters): ``async def generate(args, sample,
sampling_params) -> Sample`` posting to ``http://{args.sglang_router_ip}:{args.sglang_router_port}
/generate`` and recording model turns with ``sample.append_response_tokens(args, tokens=...,
log_probs=..., meta_info=output["meta_info"])`` and tool output with ``trainable=False`` (as
slime's examples do): that is how per-token versions are known, so a response whose tokens were
not all appended that way is refused. An aborted slime-style sample restarts from scratch.

What reaches the trainer (`GenerationResult.payload`, a `SegmentPayload` per generate
segment): `logprobs`, `nonfinite`, `loss_mask` (1 model / 0 tool), `finish`, `prompt_len`, and
`routed_experts` when the last model turn's routing covers the whole sequence (a response ending
in tool tokens has none: rollout routing replay then refuses the step, never replays wrong
rows).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from loss.named import load_function
from slime_async.contracts.rollout import (
    FinishStatus,
    GenerationRequest,
    GenerationResult,
    SegmentPayload,
    decode_routed_experts,
    segment_payload,
)
from slime_async.rollout.data.rewards import function_name
from slime_async.rollout.generate.client import GenerateClient, GenerateError
from slime_async.rollout.slime_sample import SlimeArgs, SlimeSample, is_slime_style


@dataclasses.dataclass
class Trajectory:
    """A response under construction: `output_ids` after the prompt, aligned per token."""

    prompt_ids: tuple[int, ...]
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    """1: a model token (trained); 0: tool/environment output (never in the loss)."""
    versions: list[int] = dataclasses.field(default_factory=list)
    nonfinite: list[bool] = dataclasses.field(default_factory=list)
    routed_experts: np.ndarray | None = None
    """The latest model turn's routing, `[prompt + output − 1, layers, topk]` at that time."""
    status: FinishStatus = FinishStatus.FINISHED
    finish: str | None = None
    """How the last model turn ended: "stop", "length" or "abort"."""

    def turn_lengths(self) -> list[tuple[int, int]]:
        """(loss-mask value, length) of each run of model or tool tokens, in order."""
        out: list[tuple[int, int]] = []
        for m in self.loss_mask:
            if out and out[-1][0] == m:
                out[-1] = (m, out[-1][1] + 1)
            else:
                out.append((m, 1))
        return out


class GenerateContext:
    """What a custom generate function works with (see the module docstring)."""

    def __init__(
        self, client: GenerateClient, request: GenerationRequest, *, eos_id: int, version: int
    ) -> None:
        self.client, self.request, self.eos_id = client, request, eos_id
        self.max_response_len = client.cfg.max_response_len
        self.trajectory = _resume(request, version)
        self._turn = 0

    @property
    def budget(self) -> int:
        """Response tokens left (model and tool tokens both count)."""
        return self.max_response_len - len(self.trajectory.output_ids)

    @property
    def aborted(self) -> bool:
        """The last model turn was aborted: return now, the data worker continues later."""
        return self.trajectory.status is FinishStatus.ABORTED

    async def model_turn(
        self, *, max_new_tokens: int | None = None, stop_token_ids: Sequence[int] = ()
    ) -> list[int]:
        """Generate one model turn after everything so far; returns its tokens. Ends at EOS, a
        `stop_token_ids` token, `max_new_tokens` or the budget (then `finish` is "length")."""
        t = self.trajectory
        n = self.budget if max_new_tokens is None else min(max_new_tokens, self.budget)
        if n <= 0:
            t.finish = "length"
            return []
        req = dataclasses.replace(self.request, prefix_ids=tuple(t.output_ids))
        body = self.client.build_request(req)
        body["sampling_params"]["max_new_tokens"] = n
        stops = [*body["sampling_params"].get("stop_token_ids", ()), *stop_token_ids]
        if stops:
            body["sampling_params"]["stop_token_ids"] = sorted(set(stops))
        body["rid"] = f"{body['rid']}-t{self._turn}"
        self._turn += 1
        data = await self.client.post(body, {"X-Expected-Tokens": str(n)})
        res = self.client.parse_response(data, prompt_len=len(body["input_ids"]))
        t.output_ids += res.output_ids
        got = segment_payload(res.payload)
        t.logprobs += got["logprobs"]
        t.nonfinite += got["nonfinite"]
        t.loss_mask += [1] * len(res.output_ids)
        t.versions += list(res.token_versions)
        t.status, t.finish = res.status, got.get("finish")
        if "routed_experts" in got:
            t.routed_experts = got["routed_experts"]
        return list(res.output_ids)

    def add_tool_tokens(self, ids: Sequence[int]) -> None:
        """Append tool/environment output: never trained (loss mask 0, log-prob 0), version of
        the latest model token. Tokens past the budget are cut (`finish` becomes "length")."""
        t = self.trajectory
        given = [int(i) for i in ids]
        ids = given[: max(0, self.budget)]
        if len(ids) < len(given):
            t.finish = "length"
        version = t.versions[-1] if t.versions else _first_version(self.request)
        t.output_ids += ids
        t.logprobs += [0.0] * len(ids)
        t.nonfinite += [False] * len(ids)
        t.loss_mask += [0] * len(ids)
        t.versions += [version] * len(ids)


def _first_version(request: GenerationRequest) -> int:
    runs = list(request.prefix_versions)
    return int(runs[0]) if runs else 0


def _concat(payloads: Sequence[SegmentPayload], key: str) -> list[Any]:
    return [x for p in payloads for x in p.get(key, ())]


def _resume(request: GenerationRequest, version: int) -> Trajectory:
    """The trajectory so far: the prompt plus a continued sample's earlier segments."""
    pay = [segment_payload(p) for p in request.prefix_payloads]
    n = len(request.prefix_ids)
    mask = [int(x) for x in _concat(pay, "loss_mask")] if pay else []
    return Trajectory(
        prompt_ids=tuple(request.prompt.prompt_ids),
        output_ids=list(request.prefix_ids),
        logprobs=[float(x) for x in _concat(pay, "logprobs")],
        loss_mask=mask if len(mask) == n else [1] * n,
        versions=[int(v) for v in request.prefix_versions] if n else [],
        nonfinite=[bool(x) for x in _concat(pay, "nonfinite")] or [False] * n,
        finish=pay[-1].get("finish") if pay else None,  # "abort": resume the cut model turn
    )


class CustomGenerate:
    """The data worker's `generate` for a custom function (ours or slime's)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        client: GenerateClient,
        *,
        eos_id: int,
        args: SlimeArgs | None = None,
        served_version: Callable[[], int] = lambda: 0,
    ) -> None:
        self.fn, self.client, self.eos_id, self.args = fn, client, eos_id, args
        self.slime_style = is_slime_style(fn, min_positional=3)
        self._served = served_version

    async def close(self) -> None:
        await self.client.close()

    async def __call__(
        self, req: GenerationRequest, priority: float, expected_len: int
    ) -> GenerationResult:
        del priority, expected_len
        if self.slime_style:
            return await self._slime(req)
        ctx = GenerateContext(self.client, req, eos_id=self.eos_id, version=self._served())
        await self.fn(ctx)
        return _result(ctx.trajectory, len(req.prefix_ids), self.client)

    async def _slime(self, req: GenerationRequest) -> GenerationResult:
        cfg = self.client.cfg
        sample = SlimeSample(
            index=req.sample_index,
            group_index=req.group_seq,
            tokens=list(req.prompt.prompt_ids),
            label=req.prompt.payload.get("label"),
            metadata=dict(req.prompt.payload.get("metadata") or {}),
        )
        params = {
            "max_new_tokens": cfg.max_response_len,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
            "stop_token_ids": list(cfg.stop_token_ids),
        }
        if cfg.stop:
            params["stop"] = list(cfg.stop)
        out = await self.fn(self.args, sample, params)
        if isinstance(out, list):
            raise GenerateError(
                f"{function_name(self.fn)} returned {len(out)} samples for one; a generate "
                "function that fans out into several training samples is not supported here"
            )
        return _from_slime(out, req, self.client, name=function_name(self.fn))


def _result(t: Trajectory, start: int, client: GenerateClient) -> GenerationResult:
    """The new segment of `t` (tokens after `start`) as a data-worker result."""
    seq_rows = len(t.prompt_ids) + len(t.output_ids) - 1
    payload = SegmentPayload(
        logprobs=t.logprobs[start:],
        nonfinite=t.nonfinite[start:],
        loss_mask=t.loss_mask[start:],
        finish=t.finish,
        prompt_len=len(t.prompt_ids) + start,
    )
    if t.routed_experts is not None and t.routed_experts.shape[0] == seq_rows:
        payload["routed_experts"] = t.routed_experts
    return GenerationResult(
        output_ids=t.output_ids[start:],
        token_versions=t.versions[start:],
        status=t.status,
        payload=payload,
    )


def _from_slime(
    s: Any, req: GenerationRequest, client: GenerateClient, *, name: str
) -> GenerationResult:
    prompt = list(req.prompt.prompt_ids)
    resp = [int(x) for x in s.tokens[len(prompt) :]]
    if s.tokens[: len(prompt)] != prompt or len(resp) != s.response_length:
        raise GenerateError(
            f"{name}: sample.tokens must be the prompt followed by response_length "
            f"({s.response_length}) response tokens, got {len(s.tokens)} tokens"
        )
    if s.status is SlimeSample.Status.ABORTED:  # restarts from scratch
        return GenerationResult(
            output_ids=[],
            token_versions=[],
            status=FinishStatus.ABORTED,
            payload=SegmentPayload(
                logprobs=[], nonfinite=[], finish="abort", prompt_len=len(prompt)
            ),
        )
    if len(s.token_versions) != len(resp):
        raise GenerateError(
            f"{name}: {len(resp)} response tokens but {len(s.token_versions)} were recorded with "
            "sample.append_response_tokens(args, tokens=..., log_probs=..., meta_info=...); "
            "record every model turn (and tool output with trainable=False) that way, so that "
            "each token's policy version is known"
        )
    mask = list(s.loss_mask) if s.loss_mask is not None else [1] * len(resp)
    lps = list(s.rollout_log_probs) if s.rollout_log_probs is not None else []
    if len(mask) != len(resp) or len(lps) != len(resp):
        raise GenerateError(
            f"{name}: {len(resp)} response tokens, {len(mask)} loss-mask entries and {len(lps)} "
            "rollout log-probs; they must align"
        )
    t = Trajectory(
        prompt_ids=tuple(prompt),
        output_ids=resp,
        logprobs=[float(x) for x in lps],
        loss_mask=[int(m) for m in mask],
        versions=list(s.token_versions),
        nonfinite=[False] * len(resp),
        finish="length" if s.status is SlimeSample.Status.TRUNCATED else "stop",
    )
    routed = s.rollout_routed_experts
    if isinstance(routed, str) and client.cfg.return_routed_experts:
        t.routed_experts = decode_routed_experts(
            routed, num_layers=client.num_layers, topk=client.topk
        ).astype(np.int32)
    return _result(t, 0, client)


def load_custom_generate(path: str) -> Callable[..., Any]:
    """The function at a dotted path (`pkg.mod:fn` or `pkg.mod.fn`), checked to be async."""
    fn = load_function(path)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"--custom-generate-function-path {path} must be an async function")
    return fn


def slime_args(router_url: str, **settings: Any) -> SlimeArgs:
    """The `args` of slime-style plugins: the router's address as slime names it, plus the
    run's settings under slime's names."""
    u = urlsplit(router_url)
    return SlimeArgs(sglang_router_ip=u.hostname, sglang_router_port=u.port, **settings)
