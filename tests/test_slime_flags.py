"""Every slime flag has an answer, and every command-line error is short.

* each flag of slime's `train_async` (tests/data/slime_flags.txt, read from slime's
  slime/utils/arguments.py) is accepted by `train_async.py` or has a `slime_flags.NOT_HERE` entry, which
  an unknown slime flag prints; docs/coming-from-slime.md lists the table (generated);
* a single command-line error (unknown flag, bad value, bad choice, a validation refusal)
  prints the message and one hint line, no usage block, and exits 2.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from slime_async.config import build_parser, parse_config
from slime_async.config.script_flags import RUN_TABLE
from slime_async.config.slime_flags import MEGATRON_NOT_HERE, NOT_HERE
from tests.cli_errors import error_lines

ROOT = Path(__file__).resolve().parents[1]
SLIME_FLAGS = [
    line.strip()
    for line in (ROOT / "tests" / "data" / "slime_flags.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


def _ours() -> set[str]:
    return set(build_parser()._option_string_actions)


def test_the_list_is_slimes():
    assert len(SLIME_FLAGS) > 200 and len(set(SLIME_FLAGS)) == len(SLIME_FLAGS)
    assert all(f.startswith("--") for f in SLIME_FLAGS)


def test_every_slime_flag_is_accepted_or_answered():
    ours = _ours()
    bare = [f for f in SLIME_FLAGS if f not in ours and f not in NOT_HERE]
    assert not bare, f"slime flags without an answer (add them to slime_flags.NOT_HERE): {bare}"


def test_the_table_answers_only_flags_we_do_not_take():
    ours = _ours()
    taken = sorted(f for f in [*NOT_HERE, *MEGATRON_NOT_HERE] if f in ours)
    assert not taken, f"accepted here, so not a NOT_HERE entry: {taken}"
    stray = sorted(set(NOT_HERE) - set(SLIME_FLAGS))
    assert not stray, f"not in slime's list: {stray}"


def _error_lines(argv, tmp_path, capsys) -> list[str]:
    capsys.readouterr()  # what earlier tests left behind
    with pytest.raises(SystemExit) as e:
        parse_config(["--run-dir", str(tmp_path), *argv])
    assert e.value.code == 2
    return error_lines(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--no-such-flag", "3"], "unrecognized argument --no-such-flag"),
        (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
        (["--loss-agg-mode", "x"], "invalid choice: 'x'"),
        (["--num-steps", "3", "--num-rollout", "2"], "give either --num-steps or --num-rollout"),
        (["--max-staleness", "-1"], "must be an integer >= 0, got -1"),
        (["--advantage-estimator", "ppo"], "no critic"),
        (["--offload", "--no-offload-train"], "drop one of them"),
        (["--gamma=1.0"], NOT_HERE["--gamma"]),
    ],
)
def test_one_error_is_one_message_and_a_hint(argv, says, tmp_path, capsys):
    lines = _error_lines(argv, tmp_path, capsys)
    assert len(lines) <= 3, lines
    assert lines[0].startswith("train_async.py: error: ") and says in "\n".join(lines)
    assert lines[-1] == "(train_async.py --help lists every flag)"
    assert not any(x.startswith("usage:") for x in lines)


def test_several_unknown_slime_flags_each_get_their_answer(tmp_path, capsys):
    argv = ["--release-train", "--http-proxy", "http://proxy:3128", "--bogus"]
    lines = _error_lines(argv, tmp_path, capsys)
    text = "\n".join(lines)
    assert NOT_HERE["--release-train"] in text and NOT_HERE["--http-proxy"] in text
    assert "unrecognized argument --bogus" in text


def test_no_abbreviation_turns_a_slime_flag_into_ours(tmp_path, capsys):
    lines = _error_lines(["--rollout-max-response"], tmp_path, capsys)
    assert "unrecognized argument --rollout-max-response" in lines[0]


def test_the_doc_lists_every_answer():
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts/gen_slime_flags_doc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    doc = gen.DOC.read_text()
    assert gen.render(doc) == doc, "run: python scripts/gen_slime_flags_doc.py"
    flags = [*NOT_HERE, *MEGATRON_NOT_HERE, *(f"--{d.replace('_', '-')}" for d in RUN_TABLE)]
    missing = [f for f in flags if f"`{f}`" not in doc]
    assert not missing


def test_a_megatron_flag_of_slimes_scripts_gets_its_answer(tmp_path, capsys):
    lines = _error_lines(["--multi-latent-attention", "--seq-length", "4096"], tmp_path, capsys)
    text = "\n".join(lines)
    assert "--multi-latent-attention (a Megatron flag of slime's scripts): " in text
    assert MEGATRON_NOT_HERE["--seq-length"] in text and "unrecognized argument " not in text
