"""The contracts: every value that crosses a component boundary inside `slime_async`.

Components (trainer, engine, rollout, weights, roles) import these and never each other's
internals. What lives where:

* `model` — `ModelSpec`: a decoder-only LM's shape; trainer and engine build from the same spec.
* `rollout` — `Prompt`, `GenerationRequest`/`GenerationResult`, `Sample`/`Group`/`Batch` with
  per-token versions (the data worker's types, re-exported), `SegmentPayload` (what a generate
  segment's payload holds) and SGLang's `routed_experts` codec.
* `batch` — `TrainerBatch`: the padded, token-aligned batch the trainer trains on.
* `weights` — `HFWeights` (one exported version), `WeightManifest` (names/dtypes/shapes) and
  `WeightTransport` (what the run needs from a weight transport).
* `engine` — the engine backend protocol (`EngineBackend`, `EngineLaunch`, `EngineHandle`,
  `EngineNeeds`); the registry lives in `slime_async.config.engine_backends`, the backends in
  `slime_async.orchestrator.engines`.

Submodules import only each other, the leaves (`data_worker`, `loss`) and third-party
libraries; importing this package is cheap (no torch until a submodule that needs it loads).
"""

from __future__ import annotations
