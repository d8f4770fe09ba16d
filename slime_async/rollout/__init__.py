"""The rollout component, split by role: `data` (prompt sources, tasks, datasets, reasoning-gym,
rewards, the data plan), `agents` (agent functions over the training gateway, custom generate
functions) and `generate` (the engine client, the forward-only role's log-probs, batch assembly).
`config` holds `RolloutConfig`, `slime_sample` slime's plugin view of a sample.

Submodules are imported explicitly (``from slime_async.rollout.data.tasks import TaskFamily``);
package files import nothing so that importing one submodule never drags in the others.
"""

from __future__ import annotations
