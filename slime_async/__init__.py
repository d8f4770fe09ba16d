"""slime-async: asynchronous RL post-training (rollout engines, Megatron-core trainers, Ray).

The package owns orchestration and the training/inference roles. The leaf packages `loss`,
`data_worker` and `router` never import from here; this package imports them.
"""

from __future__ import annotations

__version__ = "0.1.0"
