"""Dataset loading: jsonl/parquet, bad rows skipped and counted, strict mode, chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_async.rollout.data.datasets import (
    DatasetConfig,
    DatasetError,
    count_rows,
    load_dataset,
)

GOOD = {"prompt": "What is 2+2?", "label": "4"}


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def messy(tmp_path: Path) -> Path:
    return _write_jsonl(
        tmp_path / "messy.jsonl",
        [
            json.dumps(GOOD),  # 1
            "{not json",  # 2
            "",  # 3 blank
            json.dumps({"question": "x", "label": "1"}),  # 4 missing prompt
            json.dumps({"prompt": "   ", "label": "1"}),  # 5 empty prompt
            json.dumps({"prompt": "Name a prime."}),  # 6 missing label
            json.dumps([1, 2]),  # 7 not an object
            json.dumps({"prompt": [{"role": "user", "content": "hi"}], "label": "h"}),  # 8 chat
            json.dumps({"prompt": 12, "label": "1"}),  # 9 bad prompt type
            json.dumps({"prompt": "Say 7.", "label": 7, "source": "s1"}),  # 10
        ],
    )


def test_slimes_metadata_key_gives_each_row_its_metadata(tmp_path: Path) -> None:
    """slime's `--metadata-key`: a JSON object (or its text) per row; none when absent."""
    path = tmp_path / "m.jsonl"
    rows = [
        {"prompt": "a", "label": "1", "metadata": {"rm_type": "f1", "choices": ["x", "y"]}},
        {"prompt": "b", "label": "2", "metadata": '{"rm_type": "math"}'},
        {"prompt": "c", "label": "3"},
        {"prompt": "d", "label": "4", "metadata": "not json"},
        {"prompt": "e", "label": "5", "metadata": [1]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_dataset(DatasetConfig(path=str(path), metadata_key="metadata"))
    assert [r.metadata for r in data.rows] == [
        {"rm_type": "f1", "choices": ["x", "y"]},
        {"rm_type": "math"},
        {},
    ]
    assert data.skipped == {"bad metadata": 2}
    with pytest.raises(DatasetError, match=r"m.jsonl:4: 'metadata' must be a JSON object"):
        load_dataset(DatasetConfig(path=str(path), metadata_key="metadata", strict=True))
    assert len(load_dataset(DatasetConfig(path=str(path))).rows) == 5  # no key: not read


def test_bad_rows_are_skipped_and_counted(messy: Path) -> None:
    data = load_dataset(DatasetConfig(path=str(messy), metadata_keys=("source",)))
    assert [r.line for r in data.rows] == [1, 8, 10]
    assert data.skipped == {
        "invalid JSON": 1,
        "empty line": 1,
        "missing prompt": 1,
        "empty prompt": 1,
        "missing label": 1,
        "not an object": 1,
        "bad prompt": 1,
    }
    assert data.num_skipped == 7
    assert data.metrics() == {"data/rows": 3.0, "data/skipped": 7.0}
    assert data.rows[2].label == 7 and data.rows[2].metadata == {"source": "s1"}
    assert data.rows[0].prompt_ids is None  # no tokenizer given
    # keys are stable content hashes: reloading gives the same keys
    again = load_dataset(DatasetConfig(path=str(messy)))
    assert [r.key for r in again.rows] == [r.key for r in data.rows]
    assert len({r.key for r in data.rows}) == 3


@pytest.mark.parametrize(
    ("lines", "line_no", "what"),
    [
        ([json.dumps(GOOD), "{oops"], 2, "invalid JSON"),
        ([json.dumps(GOOD), json.dumps(GOOD), json.dumps({"prompt": ""})], 3, "'prompt' is empty"),
        ([json.dumps({"q": "a", "label": 1})], 1, "no 'prompt' field"),
        ([json.dumps(GOOD), "", json.dumps(GOOD)], 2, "empty line"),
    ],
)
def test_strict_mode_names_file_and_line(
    tmp_path: Path, lines: list[str], line_no: int, what: str
) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(DatasetError) as e:
        load_dataset(DatasetConfig(path=str(path), strict=True))
    msg = str(e.value)
    assert msg.startswith(f"{path}:{line_no}: ")
    assert what in msg and "--strict-data" in msg


def test_custom_keys_ids_and_optional_label(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            json.dumps({"id": "a1", "question": "q1", "answer": "1"}),
            json.dumps({"id": "a2", "question": "q2"}),
        ],
    )
    cfg = DatasetConfig(path=str(path), prompt_key="question", label_key="answer", id_key="id")
    data = load_dataset(cfg)
    assert [r.key for r in data.rows] == ["a1"] and data.skipped == {"missing label": 1}
    cfg2 = DatasetConfig(path=str(path), prompt_key="question", id_key="id", require_label=False)
    assert [r.label for r in load_dataset(cfg2).rows] == [None, None]


def test_unusable_files_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(DatasetConfig(path=str(tmp_path / "nope.jsonl")))
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,label\n")
    with pytest.raises(DatasetError, match=r"use \.jsonl or \.parquet"):
        load_dataset(DatasetConfig(path=str(csv)))
    wrong_key = _write_jsonl(tmp_path / "w.jsonl", [json.dumps({"text": "a", "label": "b"})])
    with pytest.raises(DatasetError, match=r"no usable rows.*prompt key 'prompt'"):
        load_dataset(DatasetConfig(path=str(wrong_key)))


def test_parquet_rows_and_strict_row_number(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    table = pa.table({"prompt": ["a?", "", "c?"], "label": ["1", "2", None]})
    pq.write_table(table, path)
    data = load_dataset(DatasetConfig(path=str(path)))
    assert [(r.prompt, r.label, r.line) for r in data.rows] == [("a?", "1", 1)]
    assert data.skipped == {"empty prompt": 1, "missing label": 1}
    with pytest.raises(DatasetError, match=r"d\.parquet \(row 2\): 'prompt' is empty"):
        load_dataset(DatasetConfig(path=str(path), strict=True))
    assert count_rows(path) == 3  # slime's --num-epoch counts the file's rows (the footer's)
    lines = tmp_path / "d.jsonl"
    lines.write_text('{"prompt": "a?"}\n\n{"prompt": "b?"}\nnot json\n')
    assert count_rows(lines) == 3  # non-blank lines, a malformed one too


def _tokenizer(chat: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [
        "<unk>",
        "<s>",
        "</s>",
        "user",
        "assistant",
        "system",
        ":",
        "what",
        "is",
        "2+2?",
        "hi",
        "be",
        "brief",
        "|",
    ]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat:
        fast.chat_template = (
            "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} | {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}"
        )
    return fast


def test_chat_template_and_tokenization(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "what is 2+2?", "label": "4"}),
            json.dumps({"prompt": [{"role": "user", "content": "hi"}], "label": "x"}),
        ],
    )
    tok = _tokenizer(chat=True)
    cfg = DatasetConfig(path=str(path), system_prompt="be brief")
    rows = load_dataset(cfg, tokenizer=tok).rows
    assert rows[0].prompt_text == "system : be brief | user : what is 2+2? | assistant :"
    assert (
        list(rows[0].prompt_ids) == tok(rows[0].prompt_text, add_special_tokens=False)["input_ids"]
    )
    assert 0 not in rows[0].prompt_ids  # every word is in the vocabulary
    assert rows[1].prompt_text == "user : hi | assistant :"
    # no template on the tokenizer: plain text (auto), or a clear error when forced
    plain = load_dataset(DatasetConfig(path=str(path)), tokenizer=_tokenizer(chat=False)).rows
    assert plain[0].prompt_text == "what is 2+2?"
    with pytest.raises(DatasetError, match="has no chat template"):
        load_dataset(
            DatasetConfig(path=str(path), apply_chat_template=True),
            tokenizer=_tokenizer(chat=False),
        )


def test_repeated_rows_are_kept_as_prompts_of_their_own(tmp_path: Path, caplog) -> None:
    from slime_async.rollout.data.sources import dataset_source

    other = {"prompt": "What is 3+3?", "label": "6"}
    path = _write_jsonl(tmp_path / "dup.jsonl", [json.dumps(r) for r in (GOOD, other, GOOD, GOOD)])
    with caplog.at_level("WARNING"):
        src = dataset_source(
            load_dataset(DatasetConfig(path=str(path)), tokenizer=_tokenizer(chat=False)),
            seed=0,
            num_epochs=1,
        )
    prompts = list(iter(src.next_prompt, None))
    assert len(prompts) == 4  # every row is trained on; none refused, none dropped
    keys = sorted(p.key for p in prompts)
    assert len(set(keys)) == 4 and sum("@" in k for k in keys) == 2  # repeats keyed by line
    assert "2 row(s) repeat an earlier row" in caplog.text
