"""slime's built-in rule-based rewards under slime's names: `--rm-type NAME`.

Owns `RM_TYPES` (the names taken), `parse_rm_type` (the parse-time check: a name slime has and
this project does not is refused with the fix), the scorers of each type (pure functions of the
response text, the label and the row's metadata) and `SlimeRewards`, the reward function
(`fn(RewardInput) -> float`, the contract of `rollout.data.rewards`) that a run with
`--rm-type` is scored by. A sample's ``metadata["rm_type"]`` overrides the run's type, as in
slime. Mathematical equality is math-verify's (as the built-in `math_verify` reward). Imports
`rollout.data.rewards` only; the remote reward model of ``remote_rm`` is handed in.

The types (the answer each one grades, and its score):
* ``deepscaler``: the last ``\\boxed{}`` answer after the last ``</think>`` (or after
  ``###Response``); a response with neither marker scores 0. 1 if equal to the label, else 0.
* ``math``: the response's last ``\\boxed{}`` answer; 1 if equal to the label, else 0.
* ``dapo``: DAPO's: the text after the last ``Answer:`` in the response's last 300 characters;
  1.0 if equal to the label, else -1.0 (also when there is no ``Answer:``); under the reward key
  ``acc`` (slime's ``--reward-key`` / ``--eval-reward-key``) 1 or 0. DAPO compares normalised
  strings of integer labels; here math-verify compares (``34.0`` is ``34``).
* ``f1``: SQuAD's token F1 of the response against the label (lower-cased, punctuation and
  articles removed; a yes/no/noanswer on one side only scores 0).
* ``gpqa``: the option letter the response picks (after ``</think>``) against the label letter
  (or the label's index, or the choice whose text the label is, from ``metadata["choices"]``).
* ``boxed_<type>``: the response's last ``\\boxed{}`` content is the answer, then <type> grades
  it (``boxed_math`` is ``math``; ``boxed_deepscaler`` needs no ``</think>``; ``boxed_dapo``
  needs no ``Answer:``); no box: the type's miss score.
* ``random``: 0 or 1 drawn from a generator seeded with the run's seed.
* ``remote_rm``: the remote reward model of ``--rm-url``.

A boxed label (``\\boxed{3}``) is unboxed first. Labels are compared as text: a number label
(``3``) is its text.
"""

from __future__ import annotations

import random
import re
import string
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from slime_async.rollout.data.rewards import RewardFn, RewardInput, _import_math_verify

RM_TYPES = ("deepscaler", "math", "dapo", "f1", "gpqa", "random", "remote_rm")
"""slime's rule-based reward types taken here (each also as ``boxed_<type>``, but
``remote_rm``)."""
DAPO_KEYS = ("score", "acc")
"""The keys of DAPO's score (slime's ``--reward-key`` / ``--eval-reward-key``): ``score``
1.0 / -1.0, ``acc`` 1 / 0."""

_FIX = (
    f"take one of {', '.join(RM_TYPES)} (or boxed_<type>), or give the reward function with "
    "--custom-rm-path pkg.mod:fn (slime's async rm(args, sample) works as is)"
)


def parse_rm_type(name: str) -> str:
    """`--rm-type NAME`: the name, stripped, when this project scores it; else ValueError
    naming the type and the fix (a type slime has and this project does not, e.g. ifbench or
    opencua_click, is a --custom-rm-path function here)."""
    name = name.strip()
    base = name.removeprefix("boxed_")
    if base == "remote_rm" and name != base:
        raise ValueError(
            f"{name!r}: the remote reward model is sent the whole response; give remote_rm "
            "(with --rm-url URL)"
        )
    if base not in RM_TYPES:
        raise ValueError(f"{name!r} is not a rule-based reward here; {_FIX}")
    return name


# ---------------------------------------------------------------------------- answers
def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in `text`, braces matched;
    None when there is none or it is not closed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:].removeprefix("\\boxed").removeprefix("\\fbox")
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):  # \boxed 5
        token = rest.split()
        return token[0].rstrip("$.") if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i]
    return None


def label_answer(label: Any) -> str:
    """The label as an answer: its text, unboxed when it holds a ``\\boxed{}``."""
    text = str(label).strip()
    if "\\boxed" in text or "\\fbox" in text:
        return last_boxed(text) or ""
    return text


def _loose(text: str) -> str:
    """An answer's text without what does not change it: spaces, `$` (and ``\\$``), the
    ``\\text{}``/``\\mathrm{}`` wrappers, ``\\left``/``\\right``, a trailing period;
    lower-cased."""
    text = re.sub(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}", r"\1", text)
    for noise in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "$", " "):
        text = text.replace(noise, "")
    return text.replace("dfrac", "frac").replace("tfrac", "frac").rstrip(".").lower()


def math_equal(answer: str, label: str) -> bool:
    """Whether `answer` and `label` are the same mathematical answer: the same text up to
    formatting, else equal by math-verify (``1/2`` = ``0.5`` = ``\\frac{1}{2}``)."""
    if not answer.strip() or not label.strip():
        return False
    if _loose(answer) == _loose(label):
        return True
    mv = _import_math_verify()
    # math-verify times out with SIGALRM, which only works on the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None

    def parse(text: str) -> Any:
        text = text.replace("\\$", "")  # a currency sign, not math
        return mv.parse(text if "$" in text else f"${text}$", parsing_timeout=timeout)

    gold, pred = parse(label), parse(answer)
    return bool(gold and pred) and bool(mv.verify(gold, pred, timeout_seconds=timeout))


# ---------------------------------------------------------------------------- scorers
Scorer = Callable[[str, Any, Mapping[str, Any], bool], float]
"""`(text, label, metadata, boxed) -> score`; `boxed`: `text` is already the boxed answer."""


def deepscaler_score(text: str, label: Any, metadata: Mapping[str, Any], boxed: bool) -> float:
    """deepscaler's: the final answer after the thinking, boxed, against the label."""
    if not boxed:
        if "</think>" in text:
            text = text.rsplit("</think>", 1)[1]
        elif "###Response" in text:
            text = text.split("###Response", 1)[1]
        else:
            return 0.0
    return math_score(text, label, metadata, boxed)


def math_score(text: str, label: Any, metadata: Mapping[str, Any], boxed: bool) -> float:
    """The last boxed answer against the label: 1 or 0."""
    answer = text if boxed else last_boxed(text)
    return float(answer is not None and math_equal(answer, label_answer(label)))


_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")


def dapo_score(text: str, label: Any, metadata: Mapping[str, Any], boxed: bool) -> float:
    """DAPO's: the answer after the last ``Answer:`` near the end, 1.0 if right else -1.0."""
    if not boxed:
        found = _ANSWER_LINE.findall(text[-300:])
        if not found:
            return -1.0
        text = found[-1]
        text = last_boxed(text) or text
    answer = text.rsplit("=", 1)[-1].strip()
    return 1.0 if math_equal(answer, label_answer(label)) else -1.0


def _squad_tokens(text: str) -> list[str]:
    text = "".join(ch for ch in str(text).lower() if ch not in string.punctuation)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def token_f1(prediction: str, truth: str) -> float:
    """SQuAD's token F1 of `prediction` against `truth` (HotpotQA's rule: a yes/no/noanswer
    answer scores only against the same)."""
    pred, gold = _squad_tokens(prediction), _squad_tokens(truth)
    special = ("yes", "no", "noanswer")
    if (" ".join(pred) in special or " ".join(gold) in special) and pred != gold:
        return 0.0
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1_score(text: str, label: Any, metadata: Mapping[str, Any], boxed: bool) -> float:
    """Token F1 against the label (the best over a list of labels)."""
    labels = label if isinstance(label, list | tuple) else [label]
    return max((token_f1(text, str(g)) for g in labels), default=0.0)


_LETTER = r"(?:\(([A-Za-z])\)|\b([A-Z])\b)"
"""An option letter: a capital, or any letter in parentheses (a lone ``a`` is a word)."""
_LETTER_PATTERNS = (
    rf"(?i:answer|option|choice)\s*(?i:is|:)?\s*{_LETTER}",
    rf"{_LETTER}\s*(?i:is\s*(?:the\s*)?correct)",
)


def _letters(metadata: Mapping[str, Any]) -> list[str]:
    if metadata.get("valid_letters"):
        return [str(x).strip().upper() for x in metadata["valid_letters"]]
    n = len(metadata.get("choices") or ()) or 10
    return list(string.ascii_uppercase[:n])


def _choices(metadata: Mapping[str, Any]) -> list[str]:
    choices = metadata.get("choices") or ()
    return [str(c) for c in (choices.values() if isinstance(choices, Mapping) else choices)]


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


def gpqa_letter(text: str, letters: list[str]) -> str | None:
    """The option letter `text` picks: the last ``answer is C`` / ``final answer: (c)``, else
    the last ``C is correct``, else its last standalone capital that is an option; None if
    none."""
    for pattern in _LETTER_PATTERNS:
        found = [(m[0] or m[1]).upper() for m in re.findall(pattern, text)]
        found = [c for c in found if c in letters]
        if found:
            return found[-1]
    standalone = [c for c in re.findall(r"\b([A-Z])\b", text) if c in letters]
    return standalone[-1] if standalone else None


def _gold_letter(label: Any, letters: list[str], choices: list[str]) -> str | None:
    if isinstance(label, int | float) and not isinstance(label, bool):
        return letters[int(label)] if 0 <= int(label) < len(letters) else None
    text = str(label).strip()
    if text.upper() in letters:
        return text.upper()
    for letter, choice in zip(letters, choices, strict=False):
        if _words(choice) == _words(text):
            return letter
    return None


def gpqa_score(text: str, label: Any, metadata: Mapping[str, Any], boxed: bool) -> float:
    """Multiple choice: the letter picked against the right one; 1.0 or 0.0. Without a letter
    either side, the right choice's text appearing in the response counts."""
    text = text.rsplit("</think>", 1)[-1]
    letters, choices = _letters(metadata), _choices(metadata)
    gold = str(metadata.get("correct_letter") or "").strip().upper() or None
    gold = gold or _gold_letter(label, letters, choices)
    picked = gpqa_letter(text, letters)
    if picked and gold:
        return float(picked == gold)
    answers = [str(metadata.get(k) or "") for k in ("correct_answer", "answer_text")]
    if gold and gold in letters and letters.index(gold) < len(choices):
        answers.append(choices[letters.index(gold)])
    if not gold:
        answers.append(str(label))
    said = f" {_words(text)} "
    return float(any(_words(a) and f" {_words(a)} " in said for a in answers))


SCORERS: dict[str, Scorer] = {
    "deepscaler": deepscaler_score,
    "math": math_score,
    "dapo": dapo_score,
    "f1": f1_score,
    "gpqa": gpqa_score,
}
"""The rule-based types that read the response (``random`` and ``remote_rm`` do not)."""


# ---------------------------------------------------------------------------- the reward
class SlimeRewards:
    """The reward of ``--rm-type NAME``: scores one sample by its ``metadata["rm_type"]``,
    else by `rm_type`, else (`rm_type` None: a run whose rows name their types) by
    `fallback`. `seed` seeds ``random``; `remote` is the ``--rm-url`` reward (None without
    one: a ``remote_rm`` sample is then an error naming the flag).

    Example::

        rm = SlimeRewards("deepscaler", seed=1)
        rm(RewardInput(response_ids=[1], response_text="...</think> so \\\\boxed{5}", label="5"))
        # 1.0
    """

    def __init__(
        self,
        rm_type: str | None,
        *,
        seed: int,
        remote: RewardFn | None = None,
        reward_key: str | None = None,
        fallback: RewardFn | None = None,
    ) -> None:
        if rm_type is None and fallback is None:
            raise ValueError("SlimeRewards needs an rm_type or a fallback reward")
        self.rm_type = parse_rm_type(rm_type) if rm_type is not None else None
        self.remote, self.fallback = remote, fallback
        self.reward_key = reward_key
        """``dapo``'s key (`DAPO_KEYS`; None: score)."""
        self._rng = random.Random(seed)

    def __repr__(self) -> str:
        return f"SlimeRewards({self.rm_type or self.fallback})"

    def __call__(self, inp: RewardInput) -> Any:
        name = self.rm_type
        if inp.metadata.get("rm_type"):
            try:
                name = parse_rm_type(str(inp.metadata["rm_type"]))
            except ValueError as e:
                raise ValueError(f"the sample's metadata rm_type {e}") from None
        if name is None:
            assert self.fallback is not None
            return self.fallback(inp)
        if name == "remote_rm":  # the reward model's answer, read under its own key
            if self.remote is None:
                raise ValueError("rm_type remote_rm needs the reward model's --rm-url URL")
            return self.remote(inp)
        base = name.removeprefix("boxed_")
        reward = self._rule(name, inp)
        if self.reward_key is None or (base == "dapo" and self.reward_key == "score"):
            return reward
        if base == "dapo" and self.reward_key == "acc":
            return float(reward > 0)
        raise ValueError(
            f"rm_type {name} gives the reward itself (a number), but the run reads it under the "
            f"key {self.reward_key!r} (--reward-key / --eval-reward-key: dapo's {DAPO_KEYS})"
        )

    def _rule(self, name: str, inp: RewardInput) -> float:
        """The score of the rule-based type `name` (not remote_rm)."""
        if name.removeprefix("boxed_") == "random":
            return float(self._rng.randint(0, 1))
        if inp.response_text is None:
            raise ValueError(f"rm_type {name} reads the response text; give the run a tokenizer")
        text, boxed = inp.response_text, name.startswith("boxed_")
        if boxed:  # no box: "" (each type's miss score)
            text = last_boxed(text) or ""
        return SCORERS[name.removeprefix("boxed_")](text, inp.label, inp.metadata, boxed)
