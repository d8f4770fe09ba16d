"""slime's `train_async.py` flags that this project does not take, each with its answer.

Owns `NOT_HERE` (one entry per slime flag that `train_async.py` here does not accept: what it
does in slime, why it is not here, and what to use instead), `MEGATRON_NOT_HERE` (the same for
the Megatron flags slime's example scripts pass that are neither accepted nor checked here, see
`script_flags`) and `explain_unrecognized` (the message argparse's "unrecognized arguments"
becomes: each such flag with its entry). Every
other flag of slime's `slime/utils/arguments.py` is accepted here under the same name
(`docs/coming-from-slime.md` says where the meaning differs); `tests/data/slime_flags.txt` is
the list, and `tests/test_slime_flags.py` checks that each of its flags is accepted or has an
entry here. Imports nothing of `slime_async`, so the parser's error path stays cheap.
"""

from __future__ import annotations

__all__ = ["MEGATRON_NOT_HERE", "NOT_HERE", "explain_unrecognized"]


def _each(flags: str, answer: str) -> dict[str, str]:
    return {f: answer for f in flags.split()}


_RELEASE_TRAIN = (
    "slime kills the Megatron actors during rollout and re-creates them from --save before "
    "each train step; not here: the actors live for the whole run, and --offload-train "
    "(on with --colocate) frees their parameters, gradients and optimizer state while the "
    "engines generate instead"
)
_WEIGHT_SYNC = (
    "a variant of slime's weight update; not here: use --update-weight-transport "
    "{distributed,disk} (disk: an HF directory under RUN_DIR/weights) and "
    "--update-weight-buffer-size (docs/weight-sync.md)"
)
_MEGATRON_HOOK = (
    "a hook into slime's Megatron actor; not here: the trainer builds its model from "
    "--hf-checkpoint's config.json (qwen2, qwen3, qwen3_moe, llama, mistral, qwen2_5_vl, qwen3_vl) and has no "
    "such hook points; plug-ins here are --custom-generate-function-path, --custom-rm-path, "
    "--custom-loss-function-path"
)
_KERNEL = (
    "a memory/kernel setting of slime's actor; not here: bound memory with "
    "--use-dynamic-batch-size --max-tokens-per-gpu and --recompute-granularity"
)
_FREEZE = "partial training; not here: every parameter of the model trains"
_PROMPT_LEN = (
    "a prompt-length filter; not here: prompts are not filtered by length; "
    "--rollout-max-response-len (--eval-max-response-len) bounds what is generated"
)
_ROLLOUT_PLUGIN = (
    "a plug-in point of slime's rollout function; not here: the data worker decides which "
    "sample is generated and trained next, so its batch cannot be rewritten; plug in with "
    "--custom-generate-function-path (generation, multi-turn), --custom-rm-path (reward), "
    "--dynamic-sampling (DAPO's group filter)"
)
_LOSS_PLUGIN = (
    "a plug-in point of slime's loss; not here: replace the whole loss with --loss or "
    "--custom-loss-function-path (fn(inputs: LossInputs, cfg), loss/README.md)"
)
_HEALTH = (
    "slime's optional fault tolerance; here always on: the router health-checks every engine "
    "(--router-health-interval-s, --router-health-timeout-s) and the supervisor restarts one "
    "that is down or does not answer a 1-token generation (--engine-restart-after, "
    "--engine-hung-timeout: slime's health-check timeout, --engine-down-timeout)"
)
_DATA = (
    "a setting of slime's data source; not here: prompts come from --prompt-data "
    "(JSONL with --input-key/--label-key) or --prompt-source"
)
_CRITIC = "a PPO critic setting; not here: there is no critic (value model)"
_EVAL_SAMPLING = (
    "an eval sampling setting; not here: eval sampling takes --eval-temperature, "
    "--eval-top-p, --eval-top-k, --eval-max-response-len (default: training's)"
)
_DEBUG = (
    "a debug/replay mode of slime; not here: --save-debug-rollout-data PATH dumps what each "
    "step sampled and trained (JSON) and --load-debug-rollout-data PATH replays it without "
    "engines (docs/replay.md)"
)
_PROFILE = "a profiling setting of slime; not here: profile the process with your own tools"
_LOG = (
    "an extra rollout log of slime; not here: every step's rollout/* metrics are in "
    "RUN_DIR/metrics.jsonl (and wandb/TensorBoard when enabled)"
)
_BUFFER = (
    "slime's external rollout buffer (agent framework); not here: generate agentic, "
    "multi-turn samples with --custom-generate-function-path"
)
_MTP = "multi-token prediction (MTP) training; not here: the trainer has no MTP head"
_CI = "slime's CI self-checks; not here (the tests under tests/ cover these)"
_DIST = "a torch.distributed setting of slime's actor; not here: the trainer sets its own"

NOT_HERE: dict[str, str] = {
    # cluster and placement
    "--num-gpus-per-node": "slime's GPUs per node for placement; not here: Ray places the "
    "trainer by --actor-num-nodes x --actor-num-gpus-per-node and the engines by "
    "--rollout-num-gpus / --rollout-num-gpus-per-engine",
    "--release-train": _RELEASE_TRAIN,
    "--qwen-gdn-backend": "the kernel of Qwen3-Next's gated delta net; not here: the trainer "
    "has no gated-delta-net models (it builds qwen2, qwen3, qwen3_moe, llama, mistral)",
    **_each(
        "--update-weight-mode --update-weight-disk-dir --update-weight-disk-keep-files "
        "--update-weight-delta-encoding --update-weight-delta-checksum "
        "--custom-update-weight-post-write-path --update-weight-local-checkpoint-dir",
        _WEIGHT_SYNC,
    ),
    **_each(
        "--custom-model-provider-path --custom-megatron-init-path "
        "--custom-megatron-before-log-prob-hook-path "
        "--custom-megatron-before-train-step-hook-path --megatron-config-path --train-backend",
        _MEGATRON_HOOK,
    ),
    **_each(
        "--recompute-loss-function --log-probs-chunk-size --log-probs-max-tokens-per-gpu "
        "--allgather-cp --megatron-deepgemm-forward-layers --megatron-deepgemm-forward-modules "
        "--megatron-deepgemm-moe-forward-layers --megatron-deepgemm-moe-forward-modules "
        "--data-pad-size-multiplier --balance-by-flops",
        _KERNEL,
    ),
    **_each("--only-train-params-name-list --freeze-params-name-list --freeze-indexer", _FREEZE),
    "--model-name": "the model's name for slime's weight conversion; not here: the family is "
    "read from --hf-checkpoint's config.json",
    "--padded-vocab-size": "Megatron's padded vocabulary; not here: the vocabulary is read "
    "from --hf-checkpoint's config.json",
    # rollout
    **_each(
        "--rollout-max-context-len --rollout-max-prompt-len --eval-max-prompt-len "
        "--eval-max-context-len",
        _PROMPT_LEN,
    ),
    "--rollout-skip-special-tokens": "how slime decodes responses; not here: the engine "
    "returns tokens and the reward function gets the decoded response as is",
    "--over-sampling-batch-size": "DAPO's over-sampling in slime; not here: with "
    "--dynamic-sampling the data worker keeps generating until a step has its groups",
    "--dynamic-sampling-filter-path": "slime's custom DAPO filter; not here: --dynamic-sampling "
    "drops groups whose rewards all agree (the only filter)",
    "--mask-offpolicy-in-partial-rollout": "not here: every token carries the policy version "
    "that generated it and CompIS corrects for its staleness; --partial-rollout requeue "
    "regenerates aborted samples whole instead",
    **_each(
        "--rollout-sample-hook-path --custom-rollout-log-function-path "
        "--custom-eval-rollout-log-function-path --buffer-filter-path "
        "--rollout-data-postprocess-path --rollout-sample-filter-path "
        "--rollout-all-samples-process-path --custom-convert-samples-to-train-data-path "
        "--custom-reward-post-process-path --eval-function-path",
        _ROLLOUT_PLUGIN,
    ),
    **_each(
        "--custom-advantage-function-path --custom-tis-function-path "
        "--custom-pg-loss-reducer-function-path",
        _LOSS_PLUGIN,
    ),
    "--rollout-data-transport": "how slime moves rollout data to the trainer; not here: the "
    "data worker hands each step's batch to the trainer itself",
    "--rollout-external-engine-addrs": "slime's external engines; here: --engine-backend "
    "external --engine-urls URL,...",
    **_each(
        "--use-fault-tolerance --rollout-health-check-interval --rollout-health-check-timeout "
        "--rollout-health-check-first-wait",
        _HEALTH,
    ),
    **_each(
        "--disable-rollout-global-dataset --data-source-path --tool-key --eval-tool-key",
        _DATA,
    ),
    "--start-rollout-id": "not here: a resumed run continues at the step its --load "
    "checkpoint recorded; a new run starts at 0",
    # eval
    "--eval-config": "slime's eval YAML; here: --eval-prompt-data NAME PATH ... with "
    "--eval-input-key, --eval-label-key, --n-samples-per-eval-prompt",
    "--skip-eval-before-train": "not here: a run with an eval set evaluates at step 0 and "
    "every --eval-interval; --eval-interval 0 turns eval off",
    "--eval-min-new-tokens": _EVAL_SAMPLING,
    # checkpoints
    **_each(
        "--ref-ckpt-step --opd-teacher-ckpt-step",
        "picks a step of a Megatron checkpoint; not here: --ref-load reads the iteration a "
        "Megatron torch_dist checkpoint's latest_checkpointed_iteration.txt names (give its "
        "iter_000000N directory to pick another), and --load resumes the newest complete "
        "checkpoint it holds",
    ),
    "--async-save": "not here: checkpoints are written synchronously and renamed into place "
    "when complete",
    "--no-save-optim": "not here: a checkpoint always holds the optimizer state (a resume "
    "continues exactly)",
    "--reset-optimizer-states": "not here: a resume restores the optimizer state; start a new "
    "run from the weights (--hf-checkpoint) for a fresh optimizer",
    "--use-stateless-adam": "not here: the optimizer is Megatron's Adam (--adam-beta1/2, "
    "--adam-eps)",
    # algorithm
    **_each(
        "--num-critic-only-steps --value-clip --gamma --lambd",
        _CRITIC,
    ),
    "--ref-update-interval": "not here: the reference policy stays the run's initial weights "
    "(or --ref-load)",
    "--use-rollout-entropy": "not here: the entropy term (--entropy-coef) is the trainer's own",
    "--get-mismatch-metrics": "not here as a flag: the train-rollout log-prob mismatch is "
    "logged at every step",
    "--use-routing-replay": "slime's replay of the old actor's MoE routing; here "
    "--routing-replay r2 (the trainer's own routing) or r3 (the engine's, "
    "--use-rollout-routing-replay)",
    **_each(
        "--use-opsm --opsm-delta",
        "off-policy sequence masking; not here: CompIS corrects each token's staleness "
        "(docs/compis.md) and --max-off-policy-steps drops too-old groups",
    ),
    **_each(
        "--use-opd --opd-type --opd-kl-coef --opd-teacher-load",
        "on-policy distillation; not here: there is no teacher model",
    ),
    **_each("--enable-mtp-training --mtp-num-layers --mtp-loss-scaling-factor", _MTP),
    "--custom-config-path": "slime's YAML for a custom function; here a loss's settings are "
    "--loss-config KEY=VALUE or --loss-config-file PATH (the CompIS adapter inside slime "
    "reads --custom-config-path there)",
    # logging
    "--wandb-key": "refused: export WANDB_API_KEY=<key> (or wandb login), so the key is in no "
    "process list or config.json",
    **_each(
        "--disable-wandb-random-suffix --wandb-always-use-train-step",
        "not here: the wandb run is named after the run directory and every record's step is "
        "the train step",
    ),
    **_each(
        "--tb-project-name --tb-experiment-name",
        "not here: --use-tensorboard writes to RUN_DIR/tensorboard",
    ),
    **_each("--log-multi-turn --log-passrate --log-reward-category --log-correct-samples", _LOG),
    **_each("--load-forge-rollout-data --check-weight-update-equal", _DEBUG),
    "--load-debug-rollout-data-subsample": "not here: a replay trains each dump whole, as the "
    "original step did (a subset would not reproduce it)",
    "--save-debug-train-data": "not here as a file of its own: the --save-debug-rollout-data "
    "dump is what the trainer is given, assembled again (bit for bit) when replayed",
    "--dump-details": "slime's shortcut for its two dumps; here --save-debug-rollout-data DIR "
    "(one JSON file per step, docs/replay.md)",
    **_each(
        "--memory-snapshot-dir --memory-snapshot-num-steps --profile-target --memory-recorder "
        "--record-memory-history",
        _PROFILE,
    ),
    # rewards and external services
    **_each(
        "--http-proxy --use-distributed-post",
        "how slime's rollout reaches its router; not here: the run's own router (--router-*) "
        "is reached directly",
    ),
    **_each(
        "--rollout-buffer-url --fetch-trajectory-retry-times --min-batch-collection-ratio "
        "--rollout-task-type --loss-mask-type",
        _BUFFER,
    ),
    **_each(
        "--ci-test --ci-disable-kl-checker --ci-train-rollout-logprob-abs-diff-threshold "
        "--ci-save-grad-norm --ci-load-grad-norm",
        _CI,
    ),
    **_each("--distributed-backend --distributed-timeout-minutes", _DIST),
    # slime's SGLang flags (slime/backends/sglang_utils/arguments.py)
    "--prefill-num-servers": "prefill/decode disaggregation; not here: every engine serves "
    "whole requests",
    "--sglang-config": "slime's YAML of SGLang server settings; not here: give SGLang flags "
    "as --sglang-FLAG VALUE (passed to every engine server)",
}


_FAMILIES = "qwen2, qwen3, qwen3_moe, llama, mistral, qwen2_5_vl, qwen3_vl"
_ARCH = (
    "a Megatron model-shape flag of a model family the trainer does not build; the supported "
    f"families ({_FAMILIES}) have no such part, and the model is built from --hf-checkpoint's "
    "config.json"
)
_MEGATRON_KERNEL = (
    "a Megatron kernel, precision or schedule setting the trainer does not expose; it runs "
    "Megatron's unfused reference kernels in fp32 or --bf16; drop the flag"
)

MEGATRON_NOT_HERE: dict[str, str] = {
    **_each(
        "--multi-latent-attention --kv-lora-rank --q-lora-rank --qk-head-dim "
        "--qk-pos-emb-head-dim --v-head-dim --mscale --mscale-all-dim --use-gated-attention "
        "--attention-output-gate --apply-layernorm-1p --post-self-attn-layernorm "
        "--post-mlp-layernorm --rotary-interleaved --no-position-embedding "
        "--moe-shared-expert-gate --moe-router-group-topk --moe-router-num-groups "
        "--moe-router-enable-expert-bias --moe-router-bias-update-rate",
        _ARCH,
    ),
    "--moe-router-load-balancing-type": "Megatron's load-balancing loss kind; not here: there "
    "is no load-balancing loss (routing replay keeps the engines' and the trainer's routing "
    "equal); drop the flag",
    **_each(
        "--spec --transformer-impl --fp8-format --fp8-recipe --moe-enable-deepep "
        "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-rope-fusion "
        "--enable-experimental --no-check-for-nan-in-loss-and-grad",
        _MEGATRON_KERNEL,
    ),
    "--make-vocab-size-divisible-by": "Megatron's vocabulary padding; not here: the vocabulary "
    "is config.json's vocab_size, unpadded",
    **_each(
        "--decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers",
        "an uneven pipeline split; not here: --pipeline-model-parallel-size splits the layers "
        "evenly",
    ),
    "--seq-length": "Megatron's fixed sequence length; not here: samples are packed at their "
    "own lengths (--rollout-max-response-len bounds them)",
}
"""Megatron flags that slime's scripts pass and `train_async.py` does not take (besides those
`script_flags` accepts), each with its answer."""


def explain_unrecognized(tokens: list[str]) -> str:
    """The message for argparse's unrecognized arguments: a slime flag with its `NOT_HERE`
    entry, a Megatron flag of slime's scripts with its `MEGATRON_NOT_HERE` entry, any other one
    as unrecognized (values that followed a flag are not repeated)."""
    flags = [t.split("=", 1)[0] for t in tokens if t.startswith("-")] or tokens
    lines = []
    for f in flags:
        if answer := NOT_HERE.get(f):
            lines.append(f"{f} (a slime flag): {answer}")
        elif answer := MEGATRON_NOT_HERE.get(f):
            lines.append(f"{f} (a Megatron flag of slime's scripts): {answer}")
        else:
            lines.append(f"unrecognized argument {f}")
    if len(lines) == 1:
        return lines[0]
    return "unrecognized arguments:\n  - " + "\n  - ".join(lines)
