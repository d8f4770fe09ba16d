"""Validation as named rules: `RULES`, in the order they run, and `derive` (flags + environment
-> `RunConfig`), which applies them.

A rule derives one fact of the run (or refuses a contradiction): it reads the flags and the
environment and the facts earlier rules set on the `Draft`, fills a flag the user left unset
(recording the value and the reason: `Flags.fill`, the 'derived:' lines) or records what a
component resolved (`Flags.note`), and never changes a flag the user set. Each is a small
function, testable alone on a hand-built draft (tests/test_config_rules.py).

The order, and why (a rule reads only what the rules above it produced; the 'derived:' lines
come out in this order):

| # | rule | derives / checks | needs |
|---|---|---|---|
| 1 | `gguf` | --hf-checkpoint: the HF directory a .gguf was converted into | the environment |
| 2 | `embedded` | the run's kind: the embedded default run or a user's model/data | 1 |
| 3 | `run_flags` | the run's own flags (ranges, --num-steps xor --num-rollout) | |
| 4 | `rollout` | the rollout settings; --global-batch-size | |
| 5 | `eval` | --eval-interval, the eval settings inherited from training | 4 |
| 6 | `steps` | --num-steps = --num-rollout (or slime's --num-epoch count) x --num-steps-per-rollout | 4 |
| 7 | `inflight` | --max-inflight from --sglang-server-concurrency | |
| 8 | `data_worker` | the data worker (--max-inflight, --fifo-window defaults) | 4, 7 |
| 9 | `schedule` | N >= S, I - 1 <= S | 8 |
| 10 | `off_policy_drop` | --max-off-policy-steps = the staleness bound | 8 |
| 11 | `loss` | the loss and its config | 4 |
| 12 | `debug_modes` | --debug-train-only; the debug modes and dump paths | 11 |
| 13 | `lr` | --lr by run kind; --lr-decay-iters, --lr-warmup-iters as slime derives them | 2, 6 |
| 14 | `run_kind` | the run-kind trainer defaults (micro batch, routing replay, snapshots) | 2, 11 |
| 15 | `behavior_forward` | where pi_j^Meg is computed: the forward-only role or the trainer | 8, 11, 14 |
| 16 | `snapshots` | --max-snapshots from the staleness bound | 10, 14, 15 |
| 17 | `bf16` | --bf16 from the CPU, the trainer's device and the run kind | 2 |
| 18 | `fused_kernels` | --cpu-fused-kernels from the run kind, the trainer's device and a C++ compiler | 2, 17 |
| 19 | `save_hf` | --save-hf (`run_paths.derive_save_hf`) | 2 |
| 20 | `trainer` | the trainer's config, checked against the model | 11-19 |
| 21 | `script_flags` | the flags of slime's scripts: Megatron's model shape against config.json, the run flags (`script_flags`) | 20 |
| 22 | `resume` | what it resumes from (`run_paths.resume_from`, `check_resume`) | 20 |
| 23 | `engines` | the engine fleet (--num-engines, --rollout-num-gpus) | |
| 24 | `placement` | --colocate, --trainer-cores, --rollout-cores; the turns of a colocated run (--offload-train, --offload-rollout, --engine-sleep-level, --engine-sleep: `colocation`) | 20, 23 |
| 25 | `cache_salt` | --router-cache-salt by engine backend | 23 |
| 26 | `keys` | the router's config and the run's two keys (a data-plane key minted) | 23 |
| 27 | `warmstart` | --warmstart-steps (`run_paths.derive_warmstart`) | 2, 22 |
| 28 | `engine` | the embedded engines' settings, --engine-dtype from the CPU | 2, 4, 23, 24 |
| 29 | `lora` | LoRA: the adapter checked against the model, the engines with LoRA on | 20, 23, 28 |
| 30 | `transport` | --update-weight-transport | 20, 23 |
| 31 | `weight_dtype` | --update-weight-dtype | 20, 28, 30 |
| 32 | `run_config` | the `RunConfig` | all |
| 33 | `batch_shape` | a resume keeps its checkpoint's batch shape | 32 |
| 34 | `memory` | the memory plan: a CPU trainer's micro-batch; a derived role that would not fit -> the trainer | 32 |

`memory` re-runs only the rules that `--behavior-forward` feeds (`memory.REFIT`: 16, 20, 22,
31, 32) when it moves pi_j^Meg to the trainer. The rules live by topic: `data` (1-12),
`training` (13-22), `serving` (23-31), `memory` (32-34); the draft and the rule type are
`draft`'s. Imports nothing of the orchestrator.
"""

from __future__ import annotations

import argparse

from slime_async.config.rules import data, memory, serving, training
from slime_async.config.rules.draft import Draft, Rule
from slime_async.config.run_config import Environment, RunConfig

__all__ = ["RULES", "Draft", "Rule", "derive"]

RULES: tuple[Rule, ...] = (
    data.gguf,
    data.embedded,
    data.run_flags,
    data.rollout,
    data.eval_settings,
    data.steps,
    data.inflight,
    data.data_worker,
    data.schedule,
    data.off_policy_drop,
    data.loss,
    data.debug_modes,
    training.lr,
    training.run_kind,
    training.behavior_forward,
    training.snapshots,
    training.bf16,
    training.fused_kernels,
    training.save_hf,
    training.trainer,
    training.script_flags,
    training.resume,
    serving.engines,
    serving.placement,
    serving.cache_salt,
    serving.keys,
    serving.warmstart,
    serving.engine,
    serving.lora,
    serving.transport,
    serving.weight_dtype,
    memory.run_config,
    memory.batch_shape,
    memory.memory,
)
"""Every rule, in the order `derive` applies them (the table above)."""


def derive(args: argparse.Namespace, env: Environment) -> RunConfig:
    """Apply `RULES` to the parsed `args` (left as given) and `env`; the resulting config.

    Raises ValueError with a sentence naming the flag and the fix."""
    draft = Draft.start(args, env)
    for r in RULES:
        r(draft)
    return draft.config
