"""The generate chain: what the data worker calls to turn one request into one scored sample.

Owns `GenerateChain` (its links, as the run keeps them), `build_generate_chain` (the one place
the chain is assembled from a `RunConfig`) and `slime_plugin_args` (the `args` that slime-style
plugins, rewards and custom generation, receive). The links, outermost first; each calls the
next with the same `(request, priority, expected_len)` and returns a `GenerationResult`:

    data worker
        │  generate(request, priority, expected_len)
        ▼
    BehaviorAnnotate   + π_j^Meg from the forward-only role     only with --behavior-forward role
        ▼
    ScoredGenerate     + reward of each finished sample         (--custom-rm-path, --group-rm)
        ▼
    CustomGenerate     multi-turn / tool use                    only with
        │                                                       --custom-generate-function-path
    or AgentGenerate   an OpenAI-client agent per sample,       only with
        │              through the training gateway             --agent-function-path
        ▼
    GenerateClient     SGLang's /generate through the router

Evaluation uses the same links below `BehaviorAnnotate` over a client of its own, sampling with
the eval settings (`--eval-temperature`, `--eval-top-p`, `--eval-max-response-len`), and
scores every sample alone (`GenerateChain.scored_alone`). Lives beside `launch` (not in `rollout`) because it reads the
whole `RunConfig`; the links themselves are rollout's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from slime_async.config.run_config import RunConfig
from slime_async.rollout.agents.agent import AgentGenerate, load_agent_function
from slime_async.rollout.agents.custom_generate import (
    CustomGenerate,
    load_custom_generate,
    slime_args,
)
from slime_async.rollout.data.plan import DataPlan
from slime_async.rollout.data.rewards import RewardInput
from slime_async.rollout.generate.assemble import Generate, ScoredGenerate
from slime_async.rollout.generate.behavior import BehaviorAnnotate, Forward
from slime_async.rollout.generate.client import GenerateClient, GenerateClientConfig
from slime_async.rollout.slime_sample import SlimeArgs


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateChain:
    """The links of one run's chain (see the module docstring for the picture)."""

    client: GenerateClient
    """The innermost link: SGLang's `/generate` through the router (closed with the run)."""
    sample: Generate
    """What generates one sample: `client`, or the custom generate function around it."""
    scored: ScoredGenerate
    """`sample` plus rewards (the run scores whole groups and reads idle time through it)."""
    head: Generate
    """What the data worker calls: `scored`, or `BehaviorAnnotate` around it."""
    eval_client: GenerateClient
    """The eval samples' client: the router, with the eval sampling settings."""
    eval_sample: Generate
    """What generates one eval sample: `eval_client`, or the custom function around it."""

    def scored_alone(self, reward_fn: Callable[[RewardInput], Any] | None = None) -> ScoredGenerate:
        """A fresh `ScoredGenerate` over `eval_sample` with `scored`'s reward settings (or
        `reward_fn`), scoring every sample on its own (a group reward sees a group of one):
        evaluation."""
        return self.scored.scoring_alone(generate=self.eval_sample, reward_fn=reward_fn)

    def role_metrics(self) -> dict[str, float]:
        """The forward-only role's `role/*` since the last call ({} without the role)."""
        return self.head.take_metrics() if isinstance(self.head, BehaviorAnnotate) else {}

    def agent_metrics(self) -> dict[str, float]:
        """The training agent link's `agent/*` counters ({} without --agent-function-path)."""
        return self.sample.metrics() if isinstance(self.sample, AgentGenerate) else {}

    async def close(self) -> None:
        """Close both clients' sessions (and the agents' gateways)."""
        for link in (self.sample, self.eval_sample):
            if isinstance(link, AgentGenerate):
                await link.close()
        await self.client.close()
        await self.eval_client.close()


def build_generate_chain(
    cfg: RunConfig,
    *,
    router_url: str,
    plan: DataPlan,
    behavior: Forward | None = None,
    served_version: Callable[[], int] = lambda: 0,
    lora_name: str | None = None,
) -> GenerateChain:
    """The run's chain against the router at `router_url`: sampling settings from
    `cfg.rollout`, routed experts when the trainer replays the engines' routing, the reward
    function, EOS and decoder of `plan`, `behavior` (the forward-only role's `logprobs`) when
    π_j^Meg is computed there, and `served_version()` (what a custom function's context
    reports as the version it generates with); `lora_name`: the adapter every request asks
    for, when pushes move a LoRA adapter."""
    r = cfg.rollout
    train_cfg = GenerateClientConfig(
        url=router_url,
        max_response_len=r.max_response_len,
        temperature=r.temperature,
        top_p=r.top_p,
        return_routed_experts=cfg.trainer.routing_replay.replays_engine_routing,
        top_k=r.top_k,
        stop=r.stop,
        stop_token_ids=(plan.eos_id, *r.stop_token_ids),
        api_key=cfg.engine.api_key,
        lora_name=lora_name,
        image_token_id=cfg.model.vision.image_token_id if cfg.model.vision else None,
    )
    eval_cfg = dataclasses.replace(
        train_cfg,
        max_response_len=r.eval_max_response_len,
        temperature=r.eval_temperature,
        top_p=r.eval_top_p,
        top_k=r.eval_top_k,
        return_routed_experts=False,  # nothing trains on eval samples
    )
    args = slime_plugin_args(cfg, router_url)

    def sampler(client_cfg: GenerateClientConfig) -> tuple[GenerateClient, Generate]:
        client = GenerateClient(
            client_cfg, num_layers=cfg.model.num_layers, topk=cfg.model.moe_topk
        )
        if r.agent_function_path:
            return client, _agent(cfg, client, plan)
        if not r.custom_generate_function_path:
            return client, client
        custom = CustomGenerate(
            load_custom_generate(r.custom_generate_function_path),
            client,
            eos_id=plan.eos_id,
            args=args,
            served_version=served_version,
        )
        return client, custom

    client, sample = sampler(train_cfg)
    eval_client, eval_sample = sampler(eval_cfg)
    scored = ScoredGenerate(
        sample,
        plan.reward_fn,
        eos_id=plan.eos_id,
        decode=plan.decode,
        reward_args=args,
        group_rm=r.group_rm,
    )
    head: Generate = scored if behavior is None else BehaviorAnnotate(scored, behavior)
    return GenerateChain(
        client=client,
        sample=sample,
        scored=scored,
        head=head,
        eval_client=eval_client,
        eval_sample=eval_sample,
    )


def slime_plugin_args(cfg: RunConfig, router_url: str) -> SlimeArgs:
    """`args` of slime-style plugins (rewards, custom generate): slime's names for our settings."""
    r = cfg.rollout
    return slime_args(
        router_url,
        router_headers=(
            {"Authorization": f"Bearer {cfg.engine.api_key}"} if cfg.engine.api_key else {}
        ),
        hf_checkpoint=cfg.trainer.hf_checkpoint,
        rollout_batch_size=r.rollout_batch_size,
        n_samples_per_prompt=r.n_samples_per_prompt,
        global_batch_size=r.global_batch_size,
        rollout_max_response_len=r.max_response_len,
        rollout_temperature=r.temperature,
        rollout_top_p=r.top_p,
        rollout_top_k=r.top_k,
        rollout_stop=list(r.stop) or None,
        rollout_stop_token_ids=list(r.stop_token_ids) or None,
        rollout_seed=cfg.rollout_seed,
        custom_rm_path=r.custom_rm_path,
        rm_type=r.rm_type,
        metadata_key=r.metadata_key,
        rm_url=r.rm_url,
        reward_key=r.reward_key,
        eval_reward_key=r.eval_reward_key,
        group_rm=r.group_rm,
        custom_generate_function_path=r.custom_generate_function_path,
        partial_rollout=cfg.data_worker.partial_rollout.value == "continue",
        use_rollout_routing_replay=cfg.trainer.routing_replay.replays_engine_routing,
    )


__all__ = ["GenerateChain", "build_generate_chain", "slime_plugin_args"]


def _agent(cfg: RunConfig, client: GenerateClient, plan: DataPlan) -> AgentGenerate:
    """The agent link: `--agent-function-path` over a training gateway of its own, rendering
    with `--hf-checkpoint`'s tokenizer (token ids as text without one)."""
    from slime_async.rollout.agents.gateway import TrainingGateway

    r = cfg.rollout
    assert r.agent_function_path is not None
    tokenizer = gateway_tokenizer(cfg.trainer.hf_checkpoint)
    gateway = TrainingGateway(
        tokenizer=tokenizer,
        eos_id=plan.eos_id,
        api_key=cfg.engine.api_key,
        template_kwargs=r.chat_template_kwargs,
    )
    return AgentGenerate(
        load_agent_function(r.agent_function_path),
        client,
        gateway,
        timeout_s=r.agent_timeout,
        decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False),
        max_turn_tokens=r.agent_max_turn_tokens,
    )


def gateway_tokenizer(hf_checkpoint: str | None) -> Any:
    """The tokenizer agents' conversations are rendered with: `hf_checkpoint`'s, else the
    id-text stand-in of models without one."""
    from slime_async.contracts.chat import IdText

    if hf_checkpoint is None:
        return IdText()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_checkpoint)
