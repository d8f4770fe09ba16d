"""The calculator tool task as an ordinary OpenAI-client agent, trained through the gateway.

Run (the tiny MoE, the built-in digit tasks, CPU; `recipes/agent-calculator.yaml`)::

    python train_async.py --config recipes/agent-calculator.yaml

The same episode as `calculator_tool.py`, but written against the `openai` package instead of
our `/generate`: the agent never sees a token id. On the tiny model (no tokenizer) message text
is token ids as decimal text and the chat template is the id stand-in (messages concatenated,
an assistant message closed by EOS, `contracts.chat`); with a chat model the same code runs
through its template.

    user       the task prompt                     e.g. "1 14 17 20 13 3" (reverse 4 1 7)
    assistant  the calculator's argument           (trained)
    tool       the calculator's output             (never trained)
    assistant  the final answer                    (trained)
    reward     `calculator_tool.reward`: 1 for the answer then EOS, 0.5 for the answer going on

The gateway pins the sampling (`--agent-max-turn-tokens` per turn, the run's temperature),
keeps each turn's sampled ids whatever the text re-encodes to, and the run's reward function
(`--custom-rm-path slime_async.examples.agent_calculator:reward`) scores the trajectory.
What it reached (its held-out curve): docs/results/2026-11-27-agent-calculator.md.
Owns nothing else.
"""

from __future__ import annotations

from typing import Any

from slime_async.examples.calculator_tool import _KINDS, calculator
from slime_async.examples.calculator_tool import reward as reward
from slime_async.rollout.data.tasks import TaskKind


def _ids(text: str | None) -> list[int]:
    return [int(t) for t in (text or "").split() if t.lstrip("-").isdigit()]


def agent(client: Any, sample: Any) -> None:
    """One episode: the argument, the calculator, the answer (reward: the run's function)."""
    kind = _KINDS.get(sample.prompt_ids[1], TaskKind.COPY)
    messages = list(sample.messages)
    first = client.chat.completions.create(model="policy", messages=messages)
    argument = first.choices[0].message.content or ""
    result = calculator(kind, _ids(argument))
    messages += [
        {"role": "assistant", "content": argument},
        {"role": "tool", "content": " ".join(str(t) for t in result)},
    ]
    client.chat.completions.create(model="policy", messages=messages)
