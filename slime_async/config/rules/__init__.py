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
| 6 | `steps` | --num-steps = --num-rollout x --num-steps-per-rollout | 4 |
| 7 | `inflight` | --max-inflight from --sglang-server-concurrency | |
| 8 | `data_worker` | the data worker (--max-inflight, --fifo-window defaults) | 4, 7 |
| 9 | `schedule` | N >= S, I - 1 <= S | 8 |
| 10 | `off_policy_drop` | --max-off-policy-steps = the staleness bound | 8 |
| 11 | `loss` | the loss and its config | 4 |
| 12 | `lr` | --lr by run kind | 2 |
| 13 | `run_kind` | the run-kind trainer defaults (micro batch, routing replay, snapshots) | 2, 11 |
| 14 | `behavior_forward` | where pi_j^Meg is computed: the forward-only role or the trainer | 8, 11, 13 |
| 15 | `snapshots` | --max-snapshots from the staleness bound | 10, 13, 14 |
| 16 | `bf16` | --bf16 from the CPU and the run kind | 2 |
| 17 | `save_hf` | --save-hf (`run_paths.derive_save_hf`) | 2 |
| 18 | `trainer` | the trainer's config, checked against the model | 11-17 |
| 19 | `script_flags` | the flags of slime's scripts: Megatron's model shape against config.json, the run flags (`script_flags`) | 18 |
| 20 | `resume` | what it resumes from (`run_paths.resume_from`, `check_resume`) | 18 |
| 21 | `engines` | the engine fleet (--num-engines, --rollout-num-gpus) | |
| 22 | `placement` | --colocate, --trainer-cores, --rollout-cores | 21 |
| 23 | `cache_salt` | --router-cache-salt by engine backend | 21 |
| 24 | `shared_token` | the router's config and the run's shared token | |
| 25 | `warmstart` | --warmstart-steps (`run_paths.derive_warmstart`) | 2, 20 |
| 26 | `engine` | the embedded engines' settings | 4, 22 |
| 27 | `lora` | LoRA: the adapter checked against the model, the engines with LoRA on | 18, 21, 26 |
| 28 | `transport` | --update-weight-transport | 18, 21 |
| 29 | `weight_dtype` | --update-weight-dtype | 18, 26, 28 |
| 30 | `run_config` | the `RunConfig` | all |
| 31 | `batch_shape` | a resume keeps its checkpoint's batch shape | 30 |
| 32 | `memory` | the memory check; a derived role that would not fit -> the trainer | 30 |

`memory` re-runs only the rules that `--behavior-forward` feeds (`memory.REFIT`: 15, 18, 20,
29, 30) when it moves pi_j^Meg to the trainer. The rules live by topic: `data` (1-11),
`training` (12-20), `serving` (21-29), `memory` (30-32); the draft and the rule type are
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
    training.lr,
    training.run_kind,
    training.behavior_forward,
    training.snapshots,
    training.bf16,
    training.save_hf,
    training.trainer,
    training.script_flags,
    training.resume,
    serving.engines,
    serving.placement,
    serving.cache_salt,
    serving.shared_token,
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
