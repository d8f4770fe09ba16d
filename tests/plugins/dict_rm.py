"""Reward functions that answer a dict, as slime's DAPO-style rewards do (`--reward-key`)."""

from __future__ import annotations


async def rm(args, sample, **kwargs):
    """slime's signature: score 1.0 / -1.0 and acc 1 / 0 of the response text against the label."""
    right = sample.response.strip() == str(sample.label)
    return {"score": 1.0 if right else -1.0, "acc": int(right), "pred": sample.response}


async def group_rm(args, samples, **kwargs):
    """slime's group form (`--group-rm`): one dict per sample."""
    return [await rm(args, s) for s in samples]


def ours(inp):
    """This project's signature, answering a dict."""
    right = (inp.response_text or "").strip() == str(inp.label)
    return {"score": 1.0 if right else -1.0, "acc": int(right)}
