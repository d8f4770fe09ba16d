"""LoRA in the Megatron trainer: adapters on the frozen base, in PEFT's names.

* the adapted model's log-probs equal those of a plain trainer holding the merged weights
  `W + (alpha / r) · B A` (1e-5), for every projection and a fused-layer subset;
* only adapter parameters train: the base is bit-identical after steps, the optimizer holds
  adapter state only;
* the exported PEFT directory loads with `peft` on the HF base and gives the same log-probs;
* TP=2 (and DP=2 with the distributed optimizer, PP=2) train exactly like TP=1 (gloo ranks);
* flags: `--lora-*` are trainer config fields; a bad target is refused by name.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.multiprocessing as mp

from slime_async.contracts.adapter import (
    PEFT_MODULES,
    LoraSpec,
    check_adapter,
    lora_spec,
    peft_shapes,
    read_peft_dir,
)
from slime_async.contracts.model import ModelSpec

pytestmark = pytest.mark.timeout(600)
torch.set_num_threads(1)

LLAMA = ModelSpec(family="llama", num_layers=2, vocab_size=512)
QWEN3 = ModelSpec(family="qwen3", num_layers=2, vocab_size=512)


def _cfg(**kw):
    from slime_async.trainer.config import TrainerConfig

    base = dict(
        lr=1e-2,
        micro_batch_size=2,
        seed=3,
        clip_grad=0.0,
        adam_eps=1e-4,
        lora_rank=4,
        lora_alpha=8.0,
    )
    base.update(kw)
    return TrainerConfig(**base)


def _batch(spec: ModelSpec):
    from slime_async.trainer.testing import random_batch

    return random_batch(spec, batch=6, width=14, prompt=4, seed=2, lengths=[14, 9, 12, 7, 10, 8])


def _randomize_b(tr, seed: int = 0) -> None:
    """B starts at zero (adapted == base); give it values so the test has teeth."""
    from slime_async.trainer import lora

    g = torch.Generator().manual_seed(seed)
    full = {
        k: torch.randn(v.shape, generator=g) * 0.05 if ".lora_B." in k else v
        for k, v in sorted(tr.export_adapter().items())
    }
    lora.load_adapter_tensors(tr.chunks, full)


@pytest.mark.parametrize(
    ("spec", "targets"),
    [(LLAMA, PEFT_MODULES), (QWEN3, ("q_proj", "v_proj", "up_proj", "down_proj"))],
    ids=["llama-all", "qwen3-subset"],
)
def test_adapter_logprobs_equal_merged_weights(spec, targets):
    from slime_async.trainer.trainer import MegatronTrainer

    tr = MegatronTrainer(_cfg(lora_target_modules=targets), spec)
    b = _batch(spec)
    base_lp = tr.compute_logprobs(b)[0]
    _randomize_b(tr)
    lp = tr.compute_logprobs(b)[0]
    assert (lp - base_lp).abs().max() > 1e-3  # the adapter changes the policy
    merged = tr.export_weights()
    adapter = tr.export_adapter()
    assert set(adapter) == set(peft_shapes(spec, tr.lora))
    tr.shutdown()
    plain = MegatronTrainer(_cfg(lora_rank=0), spec)
    plain.import_weights(merged)
    want = plain.compute_logprobs(b)[0]
    plain.shutdown()
    mask = b.loss_mask
    assert (lp - want)[mask].abs().max() <= 1e-5


def test_only_adapters_train():
    from slime_async.trainer.trainer import MegatronTrainer

    tr = MegatronTrainer(_cfg(), LLAMA)
    b = _batch(LLAMA)
    from slime_async.trainer import hf_convert

    base0 = hf_convert.megatron_to_hf(tr.chunks, LLAMA)
    ad0 = tr.export_adapter()
    for _ in range(2):
        m = tr.train_step(b)
        assert m["train/grad_norm"] > 0
    base1 = hf_convert.megatron_to_hf(tr.chunks, LLAMA)
    ad1 = tr.export_adapter()
    assert all(torch.equal(base0[k], base1[k]) for k in base0)
    assert all((ad1[k] - ad0[k]).abs().max() > 0 for k in ad0 if ".lora_B." in k)
    # the optimizer's state: two Adam moments of the adapter numbers, nothing of the base
    n_adapter = sum(t.numel() for t in ad0.values())
    assert tr.optim.state_bytes() == 2 * 4 * n_adapter
    tr.shutdown()


def test_peft_dir_loads_with_peft_and_matches(tmp_path):
    """The trainer's PEFT directory on the HF base (transformers + peft) gives the trainer's
    log-probs."""
    peft = pytest.importorskip("peft")
    import transformers

    from slime_async.trainer.trainer import MegatronTrainer

    tr = MegatronTrainer(_cfg(), LLAMA)
    _randomize_b(tr)
    tr.train_step(_batch(LLAMA))
    from slime_async.contracts.weights import HFWeights
    from slime_async.trainer import hf_convert, weights_io

    base_dir = tmp_path / "base"  # the frozen base alone (export_weights would merge)
    base = HFWeights(version=0, spec=LLAMA, tensors=hf_convert.megatron_to_hf(tr.chunks, LLAMA))
    weights_io.write_hf_dir(base, base_dir)
    tr.save_adapter(tmp_path / "adapter")
    lora_spec, tensors, version = read_peft_dir(tmp_path / "adapter")
    assert version == 1 and lora_spec == tr.lora
    check_adapter(tensors, lora_spec, LLAMA)
    b = _batch(LLAMA)
    lp = tr.compute_logprobs(b)[0]
    tr.shutdown()
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = b.tokens
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    want = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = b.loss_mask[:, 1:]
    got = lp[:, 1:]
    assert (got - want)[mask].abs().max() <= 1e-4


def test_flags_and_refusals():
    from slime_async.config import build_parser
    from slime_async.trainer.config import trainer_config_from_args

    args = build_parser().parse_args(
        ["--lora-rank", "8", "--lora-alpha", "16", "--lora-target-modules", "v_proj", "q_proj"]
    )
    cfg = trainer_config_from_args(args)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules) == (
        8,
        16.0,
        ("q_proj", "v_proj"),
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--lora-target-modules", "qkv_proj"])
    all_ = build_parser().parse_args(["--lora-target-modules", "all"])
    assert trainer_config_from_args(all_).lora_target_modules == PEFT_MODULES
    with pytest.raises(ValueError, match="qkv"):
        _cfg(lora_target_modules=("qkv",))

    with pytest.raises(ValueError, match="routed experts"):
        lora_spec(_cfg(), ModelSpec())  # the MoE default: MLP targets refused
    assert lora_spec(_cfg(lora_target_modules=("q_proj",)), ModelSpec()) is not None


def test_check_adapter_refuses_bad_tensors():
    spec = LoraSpec(rank=4, alpha=8.0)
    good = {k: torch.zeros(s) for k, s in peft_shapes(LLAMA, spec).items()}
    check_adapter(good, spec, LLAMA)
    key = sorted(good)[0]
    with pytest.raises(ValueError, match="shape"):
        check_adapter({**good, key: torch.zeros(3, 3)}, spec, LLAMA)
    with pytest.raises(ValueError, match="non-finite"):
        check_adapter({**good, key: torch.full(good[key].shape, float("nan"))}, spec, LLAMA)
    with pytest.raises(ValueError, match="missing"):
        check_adapter({k: v for k, v in good.items() if k != key}, spec, LLAMA)
    with pytest.raises(ValueError, match="max LoRA rank"):
        check_adapter(good, spec, LLAMA, max_rank=2)


# --------------------------------------------------------------------------- TP / DP / PP
LAYOUTS = {"tp2": (2, 1), "dp2": (1, 1), "pp2": (1, 2)}  # tp, pp


def _run(tr, spec):
    b = _batch(spec)
    _randomize_b(tr, seed=1)
    metrics = [tr.train_step(b) for _ in range(2)]
    return {
        "loss": torch.tensor([m["loss/total"] for m in metrics], dtype=torch.float64),
        "gnorm": torch.tensor([m["train/grad_norm"] for m in metrics], dtype=torch.float64),
        "lp": tr.compute_logprobs(b)[0],
        "adapter": tr.export_adapter(),
    }


def _worker(rank, world, port, spec_d, hf_dir, out_dir) -> None:
    torch.set_num_threads(1)
    from slime_async.trainer.trainer import MegatronTrainer

    spec = ModelSpec.from_dict(spec_d)
    results = {}
    for name, (tp, pp) in LAYOUTS.items():
        cfg = _cfg(
            hf_checkpoint=hf_dir, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
        tr = MegatronTrainer(cfg, spec, rank=rank, world_size=world, master_port=port)
        res = _run(tr, spec)
        if rank == 0:
            results[name] = res
        tr.shutdown()
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))


def test_tp2_dp2_pp2_equal_tp1(tmp_path):
    from slime_async.trainer.trainer import MegatronTrainer, free_port

    spec = dataclasses.replace(QWEN3, num_layers=2)
    ref = MegatronTrainer(_cfg(), spec)
    hf_dir = ref.save_weights(tmp_path / "init")
    want = _run(ref, spec)
    ref.shutdown()
    args = (2, free_port(), spec.to_dict(), str(hf_dir), str(tmp_path))
    mp.spawn(_worker, args=args, nprocs=2, join=True)
    res = torch.load(tmp_path / "results.pt", weights_only=True)
    assert set(res) == set(LAYOUTS)
    for name, r in res.items():
        assert (r["loss"] - want["loss"]).abs().max() <= 1e-5, (name, r["loss"], want["loss"])
        assert torch.allclose(r["gnorm"], want["gnorm"], rtol=1e-4), (name, r["gnorm"])
        assert (r["lp"] - want["lp"]).abs().max() <= 1e-4, name
        for k, v in want["adapter"].items():
            assert (r["adapter"][k] - v).abs().max() <= 1e-5, (name, k)


def test_resume_restores_adapters_and_optimizer_exactly(tmp_path):
    from slime_async.trainer.checkpoint import CheckpointError
    from slime_async.trainer.trainer import MegatronTrainer

    b = _batch(LLAMA)
    tr = MegatronTrainer(_cfg(save=str(tmp_path / "ck")), LLAMA)
    for _ in range(2):
        tr.train_step(b)
    tr.save_checkpoint()
    again = tr.train_step(b)
    want = tr.export_adapter()
    tr.shutdown()
    resumed = MegatronTrainer(_cfg(load=str(tmp_path / "ck")), LLAMA)
    assert resumed.version == 2
    cont = resumed.train_step(b)
    got = resumed.export_adapter()
    resumed.shutdown()
    assert cont["loss/total"] == again["loss/total"]
    for k in want:  # one more Adam update after the resume: moments and step restored too
        assert torch.equal(got[k], want[k]), k
    with pytest.raises(CheckpointError, match="resume with the checkpoint's --lora-rank"):
        MegatronTrainer(_cfg(load=str(tmp_path / "ck"), lora_rank=8), LLAMA)


def test_export_merged_and_peft_adapter(tmp_path):
    """A LoRA checkpoint exports (tools/export_hf) as the merged HF model and as a PEFT
    adapter; both give the trainer's log-probs (transformers; transformers + peft on the base),
    and --save-hf writes the merged model with the adapter beside it."""
    import transformers

    from slime_async.contracts.adapter import adapter_dir
    from slime_async.tools.export_hf import export_checkpoint
    from slime_async.trainer.trainer import MegatronTrainer

    init = MegatronTrainer(_cfg(lora_rank=0), LLAMA)
    base_dir = init.save_weights(tmp_path / "base")
    init.shutdown()
    b = _batch(LLAMA)
    tr = MegatronTrainer(
        _cfg(hf_checkpoint=str(base_dir), save=str(tmp_path / "ck"), save_hf=str(tmp_path / "hf")),
        LLAMA,
    )
    _randomize_b(tr)
    tr.train_step(b)
    tr.save_checkpoint()
    tr.save_hf()
    lp = tr.compute_logprobs(b)[0]
    tr.shutdown()
    export_checkpoint(tmp_path / "ck", tmp_path / "merged", adapter_out=tmp_path / "adapter")
    mask = b.loss_mask[:, 1:]

    def logprobs(model):
        with torch.no_grad():
            logits = model(input_ids=b.tokens).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, b.tokens[:, 1:, None])[..., 0]

    # --save-hf folds the adapter in tensor by tensor as it writes (`lora.merger`), the export
    # tool merges a whole copy (`lora.merge`): the same numbers
    from slime_async.trainer.weights_io import read_hf_dir

    folded, whole = read_hf_dir(tmp_path / "hf").tensors, read_hf_dir(tmp_path / "merged").tensors
    assert folded.keys() == whole.keys()
    for k, t in whole.items():
        torch.testing.assert_close(folded[k], t, rtol=0, atol=0, msg=k)
    auto = transformers.AutoModelForCausalLM
    for merged in (tmp_path / "merged", tmp_path / "hf"):
        m = auto.from_pretrained(merged, dtype=torch.float32).eval()
        assert (logprobs(m) - lp[:, 1:])[mask].abs().max() <= 1e-4, merged
    peft = pytest.importorskip("peft")
    for adapter in (tmp_path / "adapter", adapter_dir(tmp_path / "hf")):
        hf = auto.from_pretrained(base_dir, dtype=torch.float32)
        m = peft.PeftModel.from_pretrained(hf, adapter).eval()
        assert (logprobs(m) - lp[:, 1:])[mask].abs().max() <= 1e-4, adapter


def test_save_hf_never_replaces_a_users_adapter_directory(tmp_path):
    """At write time too (the directory filled after the flags were parsed): a `DIR-adapter`
    holding the user's files stops the save before either directory is written; once it is
    the run's own, a save replaces it."""
    from slime_async.contracts.adapter import adapter_dir
    from slime_async.trainer.hf_save import MARKER
    from slime_async.trainer.trainer import MegatronTrainer

    tr = MegatronTrainer(_cfg(save_hf=str(tmp_path / "hf")), LLAMA)
    try:
        mine = adapter_dir(tmp_path / "hf")
        mine.mkdir()
        (mine / "adapter_model.safetensors").write_bytes(b"the user's")
        with pytest.raises(FileExistsError, match="not written by --save-hf"):
            tr.save_hf()
        assert (mine / "adapter_model.safetensors").read_bytes() == b"the user's"
        assert not (tmp_path / "hf").exists()  # nothing written
        (mine / "adapter_model.safetensors").unlink()
        tr.save_hf()
        tr.save_hf()  # its own output: replaced
        assert (mine / MARKER).is_file() and (tmp_path / "hf" / MARKER).is_file()
    finally:
        tr.shutdown()


def test_bf16_base_fp32_adapters():
    """--bf16: the base is bf16, the adapters stay fp32 parameters and train."""
    from slime_async.trainer import lora
    from slime_async.trainer.trainer import MegatronTrainer

    tr = MegatronTrainer(_cfg(bf16=True), LLAMA)
    params = dict(tr.model.named_parameters())
    assert {p.dtype for n, p in params.items() if lora.is_adapter_param(n)} == {torch.float32}
    assert {p.dtype for n, p in params.items() if not lora.is_adapter_param(n)} == {torch.bfloat16}
    before = tr.export_adapter()
    m = tr.train_step(_batch(LLAMA))
    assert torch.isfinite(torch.tensor(m["loss/total"])) and m["train/grad_norm"] > 0
    after = tr.export_adapter()
    assert any((after[k] - before[k]).abs().max() > 0 for k in before if ".lora_B." in k)
    tr.shutdown()


def test_snapshots_hold_adapters_only_and_replay_old_versions():
    """--keep-old-actor with LoRA: each version's snapshot is its adapters (the base is shared),
    and π_j^Meg under a snapshot equals the log-probs the trainer had at version j."""
    from slime_async.trainer import lora
    from slime_async.trainer.trainer import MegatronTrainer

    tr = MegatronTrainer(_cfg(keep_old_actor=True, max_snapshots=3), LLAMA)
    b = _batch(LLAMA)
    at = {}
    for _ in range(2):
        at[tr.version] = tr.compute_logprobs(b)[0]
        tr.train_step(b)
    snap = tr.snapshots.state(1)
    assert snap and all(lora.is_adapter_param(n) for n in snap)
    n_adapter = sum(t.numel() for t in tr.export_adapter().values())
    assert sum(t.numel() for t in snap.values()) == n_adapter
    for v in (0, 1):
        assert torch.equal(tr.compute_logprobs(b, version=v)[0], at[v]), v
    assert (tr.compute_logprobs(b)[0] - at[1]).abs().max() > 0
    tr.shutdown()


def test_run_flags_for_lora():
    """A LoRA run: engines with LoRA on, sized to the adapter; the disk (adapter) transport
    derived, and π_j^Meg where a full run computes it (the forward-only role in an async run
    that reads it, else the trainer); what cannot carry adapter pushes is refused by name."""
    from slime_async.config import parse_config

    attn = ["--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj"]
    cfg = parse_config(["--lora-rank", "8", *attn, "--warmstart-steps", "0"])
    assert cfg.engine.enable_lora and cfg.engine.max_lora_rank == 8
    assert cfg.engine.lora_target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert cfg.weights.transport == "disk" and cfg.trainer.behavior_forward == "role"
    sync = parse_config(
        ["--lora-rank", "8", *attn, "--warmstart-steps", "0", "--max-staleness", "0"]
    )
    assert sync.trainer.behavior_forward == "trainer"
    with pytest.raises(SystemExit):  # MoE default model: MLP targets are routed experts
        parse_config(["--lora-rank", "8"])
    # a user's distributed transport (the adapter over the weight group) and forward-only role
    dist = parse_config(["--lora-rank", "8", *attn, "--update-weight-transport", "distributed"])
    assert dist.weights.transport == "distributed" and dist.engine.enable_lora
    role = ["--keep-old-actor", "--behavior-forward", "role", "--max-staleness", "1"]
    assert parse_config(["--lora-rank", "8", *attn, *role]).trainer.behavior_forward == "role"
    for bad in (
        ["--engine-backend", "sglang"],
        ["--engine-backend", "sglang", "--update-weight-transport", "distributed"],
    ):
        with pytest.raises(SystemExit):
            parse_config(["--lora-rank", "8", *attn, *bad])
