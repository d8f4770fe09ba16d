"""Rollout side: generate client, reward functions, tasks and datasets, advantage assembly.

Submodules are imported explicitly (``from slime_async.rollout.tasks import TaskFamily``); this
package file imports nothing so that importing one submodule never drags in the others.
"""

from __future__ import annotations
