"""slime's rule-based rewards under slime's names (`--rm-type`): each type on responses as a
Qwen3 model writes them (right, wrong, no `</think>`, no box, a boxed label), a sample's
`metadata["rm_type"]`, the types refused when the flags are parsed, and a slime script's
`--rm-type deepscaler` scoring a sample through the rollout's own scoring path."""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import AutoTokenizer

from data_worker.types import GenerationRequest, GenerationResult
from slime_async.config import parse_config
from slime_async.config.cli import build_parser
from slime_async.orchestrator.generate_chain import slime_plugin_args
from slime_async.rollout.config import rollout_config_from_args
from slime_async.rollout.data.plan import make_data_plan
from slime_async.rollout.data.rewards import (
    RewardInput,
    RewardStatus,
    compute_reward,
    math_verify_reward,
)
from slime_async.rollout.data.slime_rm import SlimeRewards, last_boxed, parse_rm_type
from slime_async.rollout.generate.assemble import ScoredGenerate
from tests.test_slime_scripts import (
    _SGLANG,
    _dry_run_out,
    _model_dir,
    _paths,
    fit_shape,
    script_argv,
    without,
)

THINK = "<think>\nOkay, 2+3. Is it \\boxed{6}? No, count again: 5.\n</think>\n\n"
RIGHT = THINK + "Adding the two numbers gives $2+3=5$.\n\nThe answer is $\\boxed{5}$."
WRONG = THINK + "Adding the two numbers gives $2+3=7$.\n\nThe answer is $\\boxed{7}$."
NO_THINK = "Adding the two numbers gives $2+3=5$. The answer is $\\boxed{5}$."
NO_BOX = THINK + "Adding the two numbers gives 5."
BOX_IN_THINKING_ONLY = "<think>\nIt is \\boxed{5}.\n</think>\n\nI am not sure."


def score(rm_type: str, response: str, label, metadata=None, seed: int = 0) -> float:
    inp = RewardInput(
        response_ids=[1, 2], response_text=response, label=label, metadata=metadata or {}
    )
    return SlimeRewards(rm_type, seed=seed)(inp)


@pytest.mark.parametrize(
    ("response", "label", "want"),
    [
        (RIGHT, "5", 1.0),
        (WRONG, "5", 0.0),
        (NO_THINK, "5", 0.0),  # only the text after </think> counts
        (NO_BOX, "5", 0.0),
        (BOX_IN_THINKING_ONLY, "5", 0.0),
        (RIGHT, "\\boxed{5}", 1.0),  # a boxed label is unboxed
        (THINK + "So $\\boxed{\\dfrac{1}{2}}$.", "0.5", 1.0),  # equal by math-verify
        (THINK + "So $\\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\frac{\\sqrt{3}}{2}", 1.0),
        ("Let me see.\n###Response\nIt is \\boxed{5}.", "5", 1.0),
        (RIGHT, "", 0.0),
        (RIGHT, 5, 1.0),  # a number label
    ],
)
def test_deepscaler(response, label, want):
    assert score("deepscaler", response, label) == want


@pytest.mark.parametrize(
    ("response", "label", "want"),
    [
        (RIGHT, "5", 1.0),  # the last box (the one in the thinking is earlier)
        (WRONG, "5", 0.0),
        (NO_THINK, "5", 1.0),  # no </think> needed
        (NO_BOX, "5", 0.0),
        (NO_THINK, "\\boxed{5}", 1.0),
        ("The ratio is \\boxed{\\frac{3}{4}}", "3/4", 1.0),
        ("The ratio is \\boxed{\\frac{3}{4}}", "4/3", 0.0),
        ("The set is \\boxed{\\{1, 2\\}}", "\\{1,2\\}", 1.0),
        ("It costs \\boxed{\\$1,000}.", "1000", 1.0),
        ("So \\boxed{x = 5}", "5", 1.0),
        ("About \\boxed{0.333}", "\\frac{1}{3}", 0.0),
    ],
)
def test_math(response, label, want):
    assert score("math", response, label) == want


@pytest.mark.parametrize(
    ("response", "label", "want"),
    [
        ("Counting the cases gives 34 in all.\n\nAnswer: 34", "34", 1.0),
        ("Counting the cases gives 35 in all.\n\nAnswer: 35", "34", -1.0),
        ("Counting the cases gives 34 in all.", "34", -1.0),  # no Answer: line
        ("Answer: 12 at first, but no.\nanswer: $34$", "34", 1.0),  # the last one counts
        ("So x = 34.\nAnswer: x = 34", "34", 1.0),
        ("Answer: 34\n" + "and then more words " * 20, "34", -1.0),  # not in the last 300
        (THINK + "Answer: \\boxed{34}", "34", 1.0),
    ],
)
def test_dapo(response, label, want):
    assert score("dapo", response, label) == want
    inp = RewardInput(response_ids=[1], response_text=response, label=label)
    assert SlimeRewards("dapo", seed=0, reward_key="score")(inp) == want
    assert SlimeRewards("dapo", seed=0, reward_key="acc")(inp) == (want + 1) / 2


def test_f1():
    assert score("f1", "The Eiffel Tower.", "eiffel tower") == 1.0
    assert score("f1", "Paris, France", "Paris") == pytest.approx(2 / 3)
    assert score("f1", "London", "Paris") == 0.0
    assert score("f1", "yes", "no") == 0.0
    assert score("f1", "yes", "yes it is") == 0.0  # a yes/no answer scores only against one
    assert score("f1", "Yes.", "yes") == 1.0
    assert score("f1", "the Louvre", ["Eiffel Tower", "Louvre"]) == 1.0  # best of the labels


def test_gpqa():
    assert score("gpqa", THINK + "The correct answer is (C).", "C") == 1.0
    assert score("gpqa", THINK + "The correct answer is (C).", "B") == 0.0
    assert score("gpqa", "<think>answer is B</think>\nC is correct.", "C") == 1.0
    assert score("gpqa", "Final answer: D", 3) == 1.0  # the label as an index
    assert score("gpqa", "The answer is a prime's letter, namely C.", "C") == 1.0  # "a": a word
    assert score("gpqa", "the answer is (c)", "C") == 1.0
    assert score("gpqa", "The answer is B. Wait, no: the answer is D.", "D") == 1.0  # the last
    choices = {"choices": ["London", "Berlin", "Paris", "Rome"]}
    assert score("gpqa", "I pick C.", "Paris", choices) == 1.0  # the label as a choice
    assert score("gpqa", "I pick A.", "Paris", choices) == 0.0
    assert score("gpqa", "It is obviously paris.", "Paris", choices) == 1.0  # no letter
    assert score("gpqa", "Between A and B, I pick B.", "A", {"choices": ["x", "y"]}) == 0.0
    assert score("gpqa", "Between A and E, I pick E.", "A", {"choices": ["x", "y"]}) == 1.0


def test_boxed_types_grade_the_boxed_answer():
    assert score("boxed_f1", "I think it is \\boxed{Eiffel Tower}", "the eiffel tower") == 1.0
    assert score("boxed_f1", "I think it is the Eiffel Tower", "the eiffel tower") == 0.0
    assert score("boxed_gpqa", "A or B? \\boxed{B}", "B") == 1.0
    assert score("boxed_gpqa", "A or B? \\boxed{A}", "B") == 0.0
    assert score("boxed_dapo", "so \\boxed{34}", "34") == 1.0
    assert score("boxed_dapo", "so 34", "34") == -1.0  # no box: DAPO's miss
    assert score("boxed_math", NO_THINK, "5") == 1.0
    assert score("boxed_deepscaler", NO_THINK, "5") == 1.0  # the box is the answer


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed 42.") == "42"
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("no box") is None


def test_random_is_seeded_and_a_sample_metadata_overrides_the_type():
    draws = [score("random", "", "", seed=3) for _ in range(3)]
    rm_a, rm_b = SlimeRewards("random", seed=3), SlimeRewards("random", seed=3)
    inp = RewardInput(response_ids=[1], response_text="x", label="")
    seq_a, seq_b = [rm_a(inp) for _ in range(64)], [rm_b(inp) for _ in range(64)]
    assert seq_a == seq_b and set(seq_a) == {0.0, 1.0} and len(set(draws)) == 1
    assert score("math", "The answer is 5", "5", {"rm_type": "f1"}) == 0.5  # f1, not math
    assert score("f1", RIGHT, "5", {"rm_type": "deepscaler"}) == 1.0


async def test_a_sample_of_a_type_not_here_is_an_error_naming_the_fix():
    inp = RewardInput(
        response_ids=[1], response_text="x", label="", metadata={"rm_type": "ifbench"}
    )
    got = await compute_reward(SlimeRewards("math", seed=0), inp)
    assert got.status is RewardStatus.ERROR and "'ifbench'" in got.error
    assert "--custom-rm-path" in got.error
    remote = RewardInput(
        response_ids=[1], response_text="x", label="", metadata={"rm_type": "remote_rm"}
    )
    got = await compute_reward(SlimeRewards("math", seed=0), remote)
    assert got.status is RewardStatus.ERROR and "--rm-url" in got.error


@pytest.mark.parametrize("name", ["ifbench", "opencua_click", "boxed_ifbench", "deepscaller"])
def test_a_type_not_here_is_refused_when_the_flags_are_parsed(name, tmp_path, capsys):
    argv = ["--run-dir", str(tmp_path), "--rm-type", name, "--dry-run"]
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2
    (line,) = [x for x in err if "--rm-type" in x and "error" in x]
    assert f"'{name}'" in line and "--custom-rm-path" in line and "deepscaler" in line


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--rm-type", "math"], "built-in tasks"),
        (["--rm-type", "math", "--custom-rm-path", "m:f"], "both name the reward"),
        (["--rm-type", "math", "--group-rm"], "both name the reward"),
        (["--rm-type", "math", "--rm-url", "http://x"], "both name the reward"),
        (["--rm-type", "remote_rm"], "give its --rm-url"),
    ],
)
def test_rm_type_flags_refuse_what_cannot_work(argv, match, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    data_flag = [] if match == "built-in tasks" else ["--prompt-data", str(data)]
    with pytest.raises(ValueError, match=match):
        rollout_config_from_args(build_parser().parse_args([*argv, *data_flag]))
    assert parse_rm_type(" boxed_math ") == "boxed_math"
    with pytest.raises(ValueError, match="give remote_rm"):
        parse_rm_type("boxed_remote_rm")


def _text_tokenizer(hf) -> None:
    """A byte-level tokenizer (any text round-trips) with a chat template, saved into `hf`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(["<pad>", "</s>", *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    fast.save_pretrained(str(hf))


async def test_a_slime_script_with_rm_type_deepscaler_scores_as_slime(tmp_path, capsys):
    """slime's Qwen3-4B script (`--rm-type deepscaler`) passes the dry run, and its run scores
    a finished sample through the rollout's scoring (`ScoredGenerate`, as the generate chain
    builds it) with deepscaler's rule."""
    hf, spec = _model_dir(tmp_path, "qwen3-tiny")
    _text_tokenizer(hf)
    argv = without(fit_shape(script_argv("qwen3-4B", _paths(tmp_path, hf)), spec), *_SGLANG)
    assert argv[argv.index("--rm-type") + 1] == "deepscaler"
    code, err, out = _dry_run_out(argv, tmp_path, capsys)
    assert code == 0, err
    assert json.loads(out)["rollout"]["rm_type"] == "deepscaler"

    cfg = parse_config([*argv, "--run-dir", str(tmp_path / "run")])
    plan = make_data_plan(
        cfg.rollout, seed=cfg.rollout_seed, hf_checkpoint=cfg.trainer.hf_checkpoint
    )
    prompt = plan.source.next_prompt()
    assert prompt.payload["label"] == "2"
    tok = AutoTokenizer.from_pretrained(str(hf))
    responses = {
        "<think>\n1+1 is \\boxed{3}? no.\n</think>\n\nSo $\\boxed{2}$.": 1.0,
        "<think>\n1+1 is 2.\n</think>\n\nSo $\\boxed{3}$.": 0.0,
        "1+1 is 2, so $\\boxed{2}$.": 0.0,  # no </think>
    }
    args = slime_plugin_args(cfg, "http://127.0.0.1:1")
    assert (args.rm_type, args.metadata_key) == ("deepscaler", "metadata")
    for text, want in responses.items():
        ids = [*tok.encode(text, add_special_tokens=False), plan.eos_id]

        async def generate(req, priority, expected_len, ids=ids):
            return GenerationResult(output_ids=ids, token_versions=[0] * len(ids))

        scored = ScoredGenerate(
            generate, plan.reward_fn, eos_id=plan.eos_id, decode=plan.decode, reward_args=args
        )
        res = await scored(GenerationRequest(prompt=prompt, group_seq=0, sample_index=0), 0, 8)
        assert res.payload["reward"] == want, text


def test_dapo_reward_keys_as_slimes_dapo_scripts(tmp_path, capsys):
    """slime's DAPO scripts: `--rm-type dapo --reward-key score --eval-reward-key acc`: training
    samples score 1.0 / -1.0, eval samples (the `--eval-prompt-data` set) 1 / 0."""
    hf, spec = _model_dir(tmp_path, "qwen3-tiny")
    _text_tokenizer(hf)
    argv = without(fit_shape(script_argv("qwen3-4B", _paths(tmp_path, hf)), spec), *_SGLANG)
    argv = [*without(argv, "--rm-type"), "--rm-type", "dapo", "--reward-key", "score"]
    argv += ["--eval-reward-key", "acc", "--run-dir", str(tmp_path / "run")]
    cfg = parse_config(argv)
    plan = make_data_plan(
        cfg.rollout, seed=cfg.rollout_seed, hf_checkpoint=cfg.trainer.hf_checkpoint
    )
    (aime,) = plan.eval_sets
    right, wrong = (
        RewardInput(response_ids=[1], response_text=f"1+1 is {x}.\nAnswer: {x}", label="2")
        for x in ("2", "3")
    )
    assert [plan.reward_fn(right), plan.reward_fn(wrong)] == [1.0, -1.0]
    assert [aime.reward_fn(right), aime.reward_fn(wrong)] == [1.0, 0.0]
    only_train = parse_config([*without(argv, "--eval-reward-key")])
    assert only_train.rollout.eval_reward_key == "score"  # slime's fallback: --reward-key
    code, err, _ = _dry_run_out(without(argv, "--eval-reward-key", "--run-dir"), tmp_path, capsys)
    assert code == 0 and "derived: --eval-reward-key score (--reward-key, as training)" in err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--rm-type", "math", "--reward-key", "score"], "gives the reward itself"),
        (["--rm-type", "dapo", "--reward-key", "reward"], "give --reward-key score or acc"),
        (["--rm-type", "dapo", "--eval-reward-key", "pred"], "give --eval-reward-key score"),
        (["--eval-reward-key", "acc"], "an --rm-url reward model or a --custom-rm-path function"),
    ],
)
def test_reward_keys_refuse_what_cannot_work(argv, match, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    with pytest.raises(ValueError, match=match):
        rollout_config_from_args(build_parser().parse_args([*argv, "--prompt-data", str(data)]))


async def test_a_rows_metadata_rm_type_scores_its_samples(tmp_path, capsys):
    """slime's `--metadata-key` (default `metadata`): a row's metadata reaches the reward, its
    `rm_type` overriding the run's `--rm-type deepscaler`, its `choices` read by gpqa."""
    hf, spec = _model_dir(tmp_path, "qwen3-tiny")
    _text_tokenizer(hf)
    argv = without(fit_shape(script_argv("qwen3-4B", _paths(tmp_path, hf)), spec), *_SGLANG)
    data = tmp_path / "mixed.jsonl"
    rows = [
        {"prompt": "1+1?", "label": "2"},
        {"prompt": "2+2?", "label": "4", "metadata": {"rm_type": "math"}},
        {
            "prompt": "Capital?",
            "label": "Paris",
            "metadata": {"rm_type": "gpqa", "choices": ["Rome", "Paris"]},
        },
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [*without(argv, "--prompt-data"), "--prompt-data", str(data)]
    cfg = parse_config([*argv, "--run-dir", str(tmp_path / "run")])
    assert cfg.rollout.metadata_key == "metadata"
    plan = make_data_plan(
        cfg.rollout, seed=cfg.rollout_seed, hf_checkpoint=cfg.trainer.hf_checkpoint
    )
    prompts = {p.payload["label"]: p for p in (plan.source.next_prompt() for _ in range(3))}
    tok = AutoTokenizer.from_pretrained(str(hf))
    cases = [
        ("2", "No thinking: \\boxed{2}", 0.0),  # the run's deepscaler wants </think>
        ("4", "No thinking: \\boxed{4}", 1.0),  # the row's math does not
        ("Paris", "The answer is B.", 1.0),  # gpqa: B is the second choice, Paris
        ("Paris", "The answer is A.", 0.0),
    ]
    for label, text, want in cases:
        ids = [*tok.encode(text, add_special_tokens=False), plan.eos_id]

        async def generate(req, priority, expected_len, ids=ids):
            return GenerationResult(output_ids=ids, token_versions=[0] * len(ids))

        scored = ScoredGenerate(generate, plan.reward_fn, eos_id=plan.eos_id, decode=plan.decode)
        req = GenerationRequest(prompt=prompts[label], group_seq=0, sample_index=0)
        assert (await scored(req, 0, 8)).payload["reward"] == want, (label, text)

    # without --rm-type, as in slime, the rows naming a type are scored by it; the others by
    # the run's default (math-verify)
    cfg = parse_config([*without(argv, "--rm-type"), "--run-dir", str(tmp_path / "run2")])
    plan = make_data_plan(cfg.rollout, seed=0, hf_checkpoint=cfg.trainer.hf_checkpoint)
    prompts = {p.payload["label"]: p for p in (plan.source.next_prompt() for _ in range(3))}
    for label, text, want in [("2", "It is 2", 1.0), ("4", "It is 4", 0.0), ("Paris", "B", 1.0)]:
        inp = RewardInput(
            response_ids=[1],
            response_text=text,
            label=label,
            metadata=prompts[label].payload["metadata"],
        )
        assert plan.reward_fn(inp) == want, (label, text)  # math_verify; math wants a box; gpqa
    data.write_text(json.dumps(rows[0]) + "\n")
    plan = make_data_plan(cfg.rollout, seed=0, hf_checkpoint=cfg.trainer.hf_checkpoint)
    assert plan.reward_fn is math_verify_reward  # no row names a type: the default as it was
    for bad, says in [("ifbench", "'ifbench' is not a rule-based"), ("remote_rm", "--rm-url")]:
        data.write_text(json.dumps({**rows[1], "metadata": {"rm_type": bad}}) + "\n")
        with pytest.raises(ValueError, match=f"mixed.jsonl:1: the row's metadata rm_type.*{says}"):
            make_data_plan(cfg.rollout, seed=0, hf_checkpoint=cfg.trainer.hf_checkpoint)


def _keyed_plan(*flags: str):
    argv = ["--custom-rm-path", "tests.plugins.dict_rm:rm", *flags]
    rollout = rollout_config_from_args(build_parser().parse_args(argv))
    return make_data_plan(rollout, seed=0, hf_checkpoint=None)


async def test_reward_key_picks_the_reward_out_of_a_custom_rm_dict():
    """slime's `--custom-rm-path` with `--reward-key`: the function answers a dict, training
    takes its value under --reward-key, eval samples under --eval-reward-key (default: the
    same key)."""
    from slime_async.rollout.agents.custom_generate import slime_args
    from slime_async.rollout.data.rewards import compute_group_rewards
    from tests.plugins.dict_rm import group_rm

    plan = _keyed_plan("--reward-key", "score", "--eval-reward-key", "acc")
    args = slime_args("http://127.0.0.1:1", n_samples_per_prompt=1)
    right = RewardInput(response_ids=[1], response_text=" 5", label="5")
    wrong = RewardInput(response_ids=[1], response_text="6", label="5")
    got = [(await compute_reward(plan.reward_fn, i, args=args)).reward for i in (right, wrong)]
    assert got == [1.0, -1.0]
    ev = [(await compute_reward(plan.eval_reward_fn, i, args=args)).reward for i in (right, wrong)]
    assert ev == [1.0, 0.0]
    same = _keyed_plan("--reward-key", "acc")
    assert (await compute_reward(same.eval_reward_fn, wrong, args=args)).reward == 0.0
    group = _keyed_plan("--reward-key", "score", "--group-rm")
    group_fn = dataclasses.replace(group.reward_fn, fn=group_rm)
    results = await compute_group_rewards(group_fn, [right, wrong], args=args)
    assert [r.reward for r in results] == [1.0, -1.0]


async def test_a_reward_key_missing_from_the_answer_names_the_key_and_the_keys_present():
    from slime_async.rollout.data.rewards import KeyedReward
    from tests.plugins.dict_rm import ours

    inp = RewardInput(response_ids=[1], response_text="5", label="5")
    got = await compute_reward(_keyed_plan("--reward-key", "reward").reward_fn, inp)
    assert got.status is RewardStatus.ERROR, got
    assert "without the key 'reward' (--reward-key)" in got.error
    assert "'score', 'acc', 'pred'" in got.error
    plain = await compute_reward(ours, inp)  # a dict without --reward-key: said, not masked
    assert plain.status is RewardStatus.ERROR and "give --reward-key KEY" in plain.error
    assert "'score', 'acc'" in plain.error
    number = await compute_reward(KeyedReward(math_verify_reward, "acc"), inp)
    assert number.status is RewardStatus.ERROR and "not a dict: --reward-key acc" in number.error
    ev = _keyed_plan("--reward-key", "score", "--eval-reward-key", "hit").eval_reward_fn
    got = await compute_reward(ev, inp, args=None)
    assert "without the key 'hit' (--eval-reward-key)" in got.error
