"""A multi-turn tool-use task on the embedded default: the model calls a calculator.

Run (the tiny MoE, the built-in digit tasks, CPU)::

    python train_async.py --num-steps 20 \\
        --custom-generate-function-path slime_async.examples.calculator_tool:generate \\
        --custom-rm-path slime_async.examples.calculator_tool:reward

An episode, in the built-in task tokens (`rollout.tasks`; id 9 is the tool marker):

    prompt   [BOS, <task>, d1 .. dn, SEP]          e.g. reverse 4 1 7
    turn 1   the model writes the calculator's argument, then EOS       (trained)
    tool     [TOOL, <copy>, r1 .. rm, SEP]: r = <task>(argument)       (never trained)
    turn 2   the model writes the final answer, then EOS                (trained)
    reward   1 if turn 2 is the prompt's answer then EOS, 0.5 if it starts with the answer
             but does not stop there, else 0

Using the tool well means passing the prompt's digits through unchanged in turn 1 and copying
the tool's result in turn 2; answering the task directly in turn 1 (what the warm-started model
does) makes the tool apply it twice, right for copy and sort, wrong for reverse and add-one. The
warm-started tiny model copies the tool's result in turn 2 but rarely stops after it (it never
saw a second turn), hence the half credit: the first thing RL has to learn is to stop.

Measured (2026-11-23, this 2-core machine, the cached warm start of seed 1 with pass rate 0.37,
`--seed 1 --num-steps 60 --eval-interval 20 --eval-prompts 32`): mean train reward per 10 steps
0.12, 0.10, 0.09, 0.15, 0.13, 0.16; held-out 0.06, 0.08, 0.08 at steps 20/40/60. The mechanics
run end to end; 60 steps move the reward little, within the noise of 32 eval prompts.

Resumable: after a weight update aborts a model turn (`--partial-rollout continue`), the data
worker re-dispatches the sample with what was generated so far and `generate` continues from the
trajectory's state; every token keeps the version that produced it. Owns nothing else; imports
the rollout component's custom-generation and task helpers.
"""

from __future__ import annotations

from slime_async.rollout.agents.custom_generate import GenerateContext
from slime_async.rollout.data.rewards import RewardInput
from slime_async.rollout.data.tasks import DIGIT0, EOS, SEP, TaskKind, encode_digits, solve

TOOL = 9
"""Marks the start of the calculator's output (a task-vocabulary id the tasks never use)."""
_KINDS = {k.token: k for k in TaskKind}


def _digits(ids: list[int]) -> str:
    return "".join(str(t - DIGIT0) for t in ids if DIGIT0 <= t < DIGIT0 + 10)


def calculator(kind: TaskKind, argument: list[int]) -> list[int]:
    """The tool's output tokens: `[TOOL, <copy>, result digits, SEP]` (no digits when the
    argument holds none)."""
    digits = _digits(argument)
    result = encode_digits(solve(kind, digits)) if digits else ()
    return [TOOL, TaskKind.COPY.token, *result, SEP]


async def generate(ctx: GenerateContext) -> None:
    """One episode (or the rest of one): turn 1, the calculator, turn 2."""
    t = ctx.trajectory
    kind = _KINDS.get(t.prompt_ids[1], TaskKind.COPY)
    cap = len(t.prompt_ids) + 2  # per model turn: the digits, EOS, one spare
    while True:
        runs = t.turn_lengths()
        phase = len(runs)  # 0: turn 1 next; 1: turn 1 done; 2: tool done; 3: turn 2 done
        if t.finish == "abort" and phase in (1, 3):  # resume the model turn a weight update cut
            await ctx.model_turn(max_new_tokens=cap - runs[-1][1])
        elif phase in (0, 2):
            await ctx.model_turn(max_new_tokens=cap)
        elif phase == 1:
            ctx.add_tool_tokens(calculator(kind, t.output_ids[: runs[0][1]]))
            t.finish = None
        else:
            return
        if ctx.aborted or ctx.budget <= 0:  # a turn's own cap just ends that turn
            return


def reward(inp: RewardInput) -> float:
    """1.0 if the last model turn (after the tool's output) is the answer then EOS, 0.5 if it
    starts with the answer but goes on, else 0.0."""
    mask = list(inp.loss_mask) if inp.loss_mask is not None else [1] * len(inp.response_ids)
    if 0 not in mask:
        return 0.0  # never called the tool
    last_tool = len(mask) - 1 - mask[::-1].index(0)
    answer = [int(x) for x in inp.response_ids[last_tool + 1 :]]
    label = inp.label if not isinstance(inp.label, str) else encode_digits(inp.label)
    label = [int(x) for x in label]
    if answer == [*label, EOS]:
        return 1.0
    return 0.5 if answer[: len(label)] == label else 0.0
