"""HF checkpoint tensors -> the served model's parameters, for weights that arrive as tensors
(`/update_weights_from_distributed`) rather than as a directory `from_pretrained` converts.

Owns `CheckpointAssembler`. Senders use checkpoint names (what the trainer exports, what SGLang
loads): one tensor per expert and projection. transformers 5 serves MoE experts fused:
`mlp.experts.gate_up_proj [E, 2I, H]` (expert e's gate rows, then its up rows, as transformers'
own loader concatenates them) and `mlp.experts.down_proj [E, H, I]`. Every other name maps to
itself, but for a vision-language model's, which transformers 5 serves under other prefixes than
it saves (`visual.*` → `model.visual.*`, `model.*` → `model.language_model.*`). The pieces of a
fused parameter may arrive over several calls (buckets); a parameter is
ready once all its pieces are there, and pieces wait meanwhile.
Must never import the server, the scheduler or aiohttp.

Worked example (E = 2): bucket 1 holds `...experts.0.gate_proj.weight`, `...experts.0.up_proj.weight`,
`...experts.1.gate_proj.weight`: nothing fused is ready; bucket 2 brings
`...experts.1.up_proj.weight`: `...experts.gate_up_proj` is ready, stacked [2, 2I, H].
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_EXPERT = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


_VL_PREFIXES = (("visual.", "model.visual."), ("model.", "model.language_model."))


class CheckpointAssembler:
    """Collects checkpoint-named tensors into served parameters (`want`: name -> shape)."""

    def __init__(self, want: Mapping[str, tuple[int, ...]]) -> None:
        self.want = dict(want)
        self.pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
        """Fused parameter -> the pieces received so far, by (expert, projection)."""

    def _target(self, name: str) -> tuple[str, int, str] | None:
        m = _EXPERT.match(name)
        if m is None:
            return None
        proj = m["proj"]
        fused = f"{m['prefix']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        return (fused, int(m["e"]), proj) if fused in self.want else None

    def served(self, name: str) -> str:
        """The served name of checkpoint name `name` (itself unless a VL prefix maps it)."""
        if name in self.want:
            return name
        for saved, served in _VL_PREFIXES:
            if name.startswith(saved) and served + name[len(saved) :] in self.want:
                return served + name[len(saved) :]
        return name

    def add(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """Take a call's tensors; returns the parameters now complete, and every problem (a
        name the model does not have, a wrong shape). Nothing is kept from a call with problems."""
        ready: dict[str, torch.Tensor] = {}
        pieces: list[tuple[str, int, str, torch.Tensor]] = []
        bad: list[str] = []
        for name, t in tensors.items():
            name = self.served(name)
            if name in self.want:
                if tuple(t.shape) != self.want[name]:
                    bad.append(
                        f"{name!r} has shape {tuple(t.shape)}, the model's is {self.want[name]}"
                    )
                ready[name] = t
                continue
            tgt = self._target(name)
            if tgt is None:
                bad.append(f"unknown tensor {name!r}")
                continue
            fused, e, proj = tgt
            shape = self.want[fused]  # [E, 2I, H] or [E, H, I]
            rows = shape[1] // 2 if proj != "down_proj" else shape[1]
            piece = (rows, shape[2])
            if e >= shape[0] or tuple(t.shape) != piece:
                bad.append(
                    f"{name!r} has shape {tuple(t.shape)} (expert {e}); the model's "
                    f"experts are {shape[0]} pieces of {piece}"
                )
                continue
            pieces.append((fused, e, proj, t))
        if bad:
            return {}, bad
        for fused, e, proj, t in pieces:
            got = self.pending.setdefault(fused, {})
            got[(e, proj)] = t
            n_exp = self.want[fused][0]
            need = n_exp if proj == "down_proj" else 2 * n_exp
            if len(got) == need:
                del self.pending[fused]
                if proj == "down_proj":
                    ready[fused] = torch.stack([got[(i, "down_proj")] for i in range(n_exp)])
                else:
                    ready[fused] = torch.stack(
                        [
                            torch.cat([got[(i, "gate_proj")], got[(i, "up_proj")]])
                            for i in range(n_exp)
                        ]
                    )
        return ready, bad

    def incomplete(self) -> list[str]:
        """Fused parameters with some pieces still missing."""
        return sorted(self.pending)

    def reset(self) -> None:
        self.pending.clear()
