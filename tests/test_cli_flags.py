"""The command line is generated from the config dataclasses (`clifields`), once per flag, and a
run's recorded config replays.

* every flag of `train_async.py --help` comes from exactly one config field (none hand-written);
* `--dry-run` prints the config that `--config <that file>` rebuilds byte for byte;
* the generator itself: help from the field docstring, derived defaults, ranges, switches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Literal

import pytest

from clifields import StrEnum, add_flags, check_ranges, flag, flag_of, from_args
from slime_async.config import build_parser, parse_config


def test_every_flag_is_one_config_field():
    parser = build_parser()
    seen: dict[tuple[type, str], list[str]] = {}
    hand_written = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        origin = flag_of(action)
        if origin is None:
            hand_written.append(action.option_strings)
        else:
            seen.setdefault(origin, []).append(action.option_strings[0])
    assert not hand_written, f"flags not generated from a config field: {hand_written}"
    twice = {f"{c.__name__}.{n}": opts for (c, n), opts in seen.items() if len(opts) > 1}
    assert not twice, f"fields with more than one flag: {twice}"
    undocumented = [
        a.option_strings[0]
        for a in parser._actions
        if flag_of(a) and a.help.startswith("(undocumented)")
    ]
    assert not undocumented, f"flags whose field has no docstring: {undocumented}"
    assert len(seen) > 100


def _dry_run(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        parse_config([*argv, "--dry-run"])
    assert e.value.code == 0
    out = capsys.readouterr()
    assert "derived: --max-snapshots" in out.err
    return out.out


@pytest.mark.parametrize(
    "argv",
    [
        (),
        (
            "--max-staleness",
            "3",
            "--loss",
            "ppo",
            "--lr",
            "3e-5",
            "--rollout-stop",
            "a",
            "b",
            "--fifo-window",
            "inf",
            "--max-off-policy-steps",
            "9",
            "--keep-old-actor",
        ),
    ],
    ids=["defaults", "given"],
)
def test_dry_run_prints_a_config_that_replays_to_the_same_config(tmp_path, capsys, argv):
    run = ("--run-dir", str(tmp_path / "run"))
    first = _dry_run(capsys, *run, *argv)
    record = json.loads(first)
    assert record["derived"]["--max-snapshots"]["value"] == record["trainer"]["max_snapshots"]
    assert not (tmp_path / "run").exists()  # a dry run starts nothing and writes nothing
    saved = tmp_path / "config.json"
    saved.write_text(first)
    assert _dry_run(capsys, "--config", str(saved)) == first
    # what the user gave stays given; the derived values are derived again, not pinned
    assert record["flags"]["max_snapshots"] is None


def test_a_replayed_config_still_lets_the_command_line_win(tmp_path, capsys):
    saved = tmp_path / "config.json"
    saved.write_text(_dry_run(capsys, "--run-dir", str(tmp_path / "run"), "--max-staleness", "3"))
    again = json.loads(_dry_run(capsys, "--config", str(saved), "--max-staleness", "1"))
    assert again["data_worker"]["max_staleness"] == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"max-staleness": 1}))
    with pytest.raises(SystemExit):
        parse_config(["--config", str(bad)])
    assert "a run's config.json" in capsys.readouterr().err


# ------------------------------------------------------------------------- the generator


class Color(StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Example:
    steps: int = flag(3, ge=1, hint="1 = one step")
    """Steps to run."""
    rate: float | None = flag(None, derived="twice the steps")
    """The rate."""
    color: Color = Color.RED
    """A color."""
    mode: Literal["a", "b"] = "a"
    """A mode."""
    names: tuple[str, ...] = ()
    """Some names."""
    fast: bool = flag(True, name="go-fast", off=("--slow",))
    """Go fast."""
    hidden: int = flag(0, cli=False)
    """Set by the program."""
    label: str | None = flag("x", parse=lambda s: None if s == "none" else s)
    """A label ('none': no label)."""

    def __post_init__(self) -> None:
        check_ranges(self)


def _example(*argv: str) -> tuple[argparse.ArgumentParser, Example]:
    parser = argparse.ArgumentParser()
    add_flags(parser, Example, group="example")
    return parser, from_args(Example, parser.parse_args(list(argv)))


def test_flags_come_from_the_fields():
    parser, cfg = _example()
    assert cfg == Example()
    text = parser.format_help()
    assert "Steps to run." in text and "twice the steps" in text and "--hidden" not in text
    assert "--go-fast" in text and "--no-go-fast" in text and "{red,blue}" in text
    _, cfg = _example(
        "--steps",
        "5",
        "--rate",
        "0.5",
        "--color",
        "blue",
        "--mode",
        "b",
        "--names",
        "p",
        "q",
        "--slow",
        "--label",
        "none",
    )
    assert cfg == Example(
        steps=5, rate=0.5, color=Color.BLUE, mode="b", names=("p", "q"), fast=False, label=None
    )
    assert _example("--no-go-fast")[1].fast is False


def test_a_program_may_derive_a_field_the_class_defaults():
    """`add_flags(derived=...)`: the flag defaults to None (the program derives it, the help says
    how) while the class, and any other program's flag of it, keeps its default."""
    p = argparse.ArgumentParser()
    add_flags(p, Example, prefix="x-", only=("color",), derived={"color": "from the sky"})
    assert p.parse_args([]).x_color is None and "derived: from the sky" in p.format_help()
    assert p.parse_args(["--x-color", "blue"]).x_color == "blue"
    assert _example()[1].color == Example().color  # the plain flags keep the class default


def test_bad_values_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        _example("--mode", "c")
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--steps must be >= 1 \(1 = one step\), got 0"):
        _example("--steps", "0")
