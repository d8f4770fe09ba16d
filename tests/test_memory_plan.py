"""The start-up memory check (`slime_async/config/memory_plan.py`, the `memory` rule of `slime_async.config.rules`): parameter counts
against real models, a derived forward-only role that would not fit becomes `--behavior-forward
trainer` (logged with the numbers), a run that cannot fit is refused with them, and a user's
`--behavior-forward role` is never changed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slime_async.config import Environment, build_parser, validate
from slime_async.config.memory_plan import MEMORY_FRACTION, RUNTIME, param_count
from slime_async.config.rules.memory import MICRO_BATCHES, memory_parts, run_shape
from slime_async.contracts.model import SMOLLM2_135M, TINY_MOE, ModelSpec

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

SMOLLM2 = SMOLLM2_135M
ASYNC = ("--hf-checkpoint", "/m", "--prompt-data", "t.jsonl", "--keep-old-actor")
BATCH = ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024")
"""Micro-batching given: the plan derives none (the role fallback alone is tested)."""
GIB = 1024**3


def _cfg(*argv: str, memory: int | None):
    env = Environment(model=SMOLLM2, cpus=(0, 1), memory_bytes=memory)
    return validate(build_parser().parse_args(list(argv)), env)


def test_param_count_matches_built_models():
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.forward_only import ForwardOnlyModel

    assert param_count(SMOLLM2) == 134_515_008  # SmolLM2-135M's published count
    for spec in (TINY_MOE, ModelSpec(family="qwen2", num_layers=1)):
        model = ForwardOnlyModel(TrainerConfig(), spec).model
        assert param_count(spec) == sum(p.numel() for p in model.parameters()), spec.family


def test_a_role_that_would_not_fit_is_derived_away_with_the_numbers():
    free = _cfg(*ASYNC, *BATCH, memory=None)
    assert free.trainer.behavior_forward == "role"  # what the run derives with room to spare
    lean = _cfg(*ASYNC, *BATCH, "--behavior-forward", "trainer", memory=None)
    need_role, need_trainer = (sum(memory_parts(c).values()) for c in (free, lean))
    assert need_trainer < need_role
    memory = int((need_role + need_trainer) / 2 / MEMORY_FRACTION)
    cfg = _cfg(*ASYNC, *BATCH, memory=memory)
    assert cfg.trainer.behavior_forward == "trainer"
    why = cfg.derived["--behavior-forward"].why
    assert "would not fit" in why and "GiB" in why and "role" in why
    assert cfg.trainer.max_snapshots == lean.trainer.max_snapshots  # re-derived for the trainer
    assert dataclasses.replace(cfg, derived={}, flags=()) == dataclasses.replace(
        lean, derived={}, flags=()
    )


def test_a_run_that_cannot_fit_is_refused_with_the_numbers_and_a_given_role_is_kept():
    with pytest.raises(ValueError, match=r"would not fit .*trainer .* GiB .*--bf16"):
        _cfg(*ASYNC, memory=2 * 1024**3)
    free = _cfg(*ASYNC, *BATCH, memory=None)
    memory = int(sum(memory_parts(free).values()) / MEMORY_FRACTION) - 1
    with pytest.raises(ValueError, match="role"):  # the user asked for the role: refused
        _cfg(*ASYNC, *BATCH, "--behavior-forward", "role", memory=memory)
    assert _cfg(*ASYNC, memory=64 * 1024**3).trainer.behavior_forward == "role"


def test_with_lora_the_role_holds_the_base_once_and_an_adapter_per_version():
    from slime_async.config.memory_plan import RUNTIME, RunShape, forward_bytes, process_bytes
    from slime_async.contracts.adapter import LoraSpec, adapter_numel

    lora = LoraSpec(rank=8, alpha=16.0)
    a, n = adapter_numel(SMOLLM2, lora), param_count(SMOLLM2)
    shape = RunShape(spec=SMOLLM2, role_versions=3, trainer_snapshots=0, adapter_params=a)
    role = RUNTIME["role"]
    flight = 4 * a  # the adapter of a version in flight (fp32 through the object store)
    assert process_bytes(shape)["role"] == role + 4 * n + 4 * a * (1 + 3) + flight
    full = process_bytes(dataclasses.replace(shape, adapter_params=0))
    # three versions (the model's parameters are the newest one's) + the incoming file, mapped
    assert full["role"] == role + 4 * n * 3 + 4 * n
    assert process_bytes(shape)["trainer"] < full["trainer"]
    cfg = _cfg(*ASYNC, "--lora-rank", "8", "--behavior-forward", "role", memory=None)
    parts = memory_parts(cfg)
    rs = run_shape(cfg)
    fwd = forward_bytes(
        SMOLLM2, rs.micro_batch_tokens, bf16=cfg.trainer.bf16, head_tokens=rs.head_tokens
    )
    want = role + 4 * n + 4 * a * (1 + cfg.trainer.max_snapshots) + 4 * a
    assert parts["role"] - fwd == want


def test_the_trainer_holds_no_export_and_the_role_no_copy_beside_its_versions():
    """The trainer's pushes and the role's file read views of its parameters: no version in
    flight is counted in the trainer (the engines still receive one each); the role holds its
    versions in the parameters' dtype and the incoming one, nothing else per parameter."""
    from slime_async.config.memory_plan import RunShape, process_bytes, trainer_state_bytes

    n = param_count(SMOLLM2)
    shape = RunShape(spec=SMOLLM2, bf16=True, role_versions=5, engines=1, wire_bytes=2)
    parts = process_bytes(shape)
    assert parts["trainer"] == RUNTIME["trainer"] + trainer_state_bytes(shape)
    assert parts["role"] == RUNTIME["role"] + 2 * n * 5 + 2 * n
    assert parts["engines"] == RUNTIME["engine"] + 2 * n + 2 * n  # its weights + one in flight


def test_the_fused_kernels_runtime_is_counted_in_the_trainer_and_the_role_on_cpus():
    """`--cpu-fused-kernels` (derived on with a compiler on the node) adds Inductor's bytes to
    each CPU trainer rank, not to the role (eager); nothing where the trainer is on GPUs."""
    from slime_async.config.memory_plan import FUSED_RUNTIME, RunShape, process_bytes

    shape = RunShape(spec=SMOLLM2, bf16=True, role_versions=5, trainer_ranks=2)
    on, off = process_bytes(dataclasses.replace(shape, fused_kernels=True)), process_bytes(shape)
    assert on["trainer"] - off["trainer"] == 2 * FUSED_RUNTIME
    assert on["role"] == off["role"]
    gpu = dataclasses.replace(shape, trainer_on_gpu=True)
    assert process_bytes(dataclasses.replace(gpu, fused_kernels=True)) == process_bytes(gpu)
    env = Environment(model=SMOLLM2, cpus=(0, 1), memory_bytes=64 * GIB, cxx="/usr/bin/g++")
    cfg = validate(build_parser().parse_args([*ASYNC, *BATCH]), env)
    assert cfg.trainer.cpu_fused_kernels and run_shape(cfg).fused_kernels


def test_only_the_read_positions_count_in_the_heads_logits():
    """A fixed micro-batch's head sees its responses only (`head_tokens`); a token budget's
    mix is unknown, so all of its tokens are counted."""
    from slime_async.config.memory_plan import (
        HEAD_TEMPORARIES,
        _head_bytes,
        activation_bytes,
        forward_bytes,
        head_tile,
    )

    spec = TINY_MOE
    v, h = spec.vocab_size, spec.hidden_size
    assert head_tile(1024, v) == (1024, 1024) and head_tile(200, v) == (200, v)
    lean = _head_bytes(1024, v, h, None, 4) - _head_bytes(200, v, h, None, 4)
    assert lean > 0
    assert activation_bytes(spec, 1024, bf16=False) - lean == activation_bytes(
        spec, 1024, bf16=False, head_tokens=200
    )
    tiles = HEAD_TEMPORARIES * 4 * (1024 * 1024 - 200 * v)  # one tile's logits, fewer rows
    assert forward_bytes(spec, 1024, bf16=False) - tiles == forward_bytes(
        spec, 1024, bf16=False, head_tokens=200
    )
    cfg = _cfg(*ASYNC, "--micro-batch-size", "2", memory=None)
    fixed = run_shape(cfg)
    assert fixed.head_tokens == 2 * cfg.rollout.max_response_len < fixed.micro_batch_tokens
    assert run_shape(_cfg(*ASYNC, *BATCH, memory=None)).head_tokens is None


def test_the_plan_tiles_the_head_as_the_trainer_does():
    """The plan's copy of the head's tiling rule (the config must not import torch) equals the
    trainer's, for read counts around the chunk limit, vocabularies small and large, and a
    given `--logits-chunk-tokens`, on a CPU and on a GPU (whole-vocabulary chunks: a GPU
    trainer's plan counts those, four times the CPU's tiles at SmolLM2's vocabulary)."""
    from slime_async.config.memory_plan import head_tile
    from slime_async.trainer.lm_head import tiling

    for read in (1, 85, 700, 1307, 2048, 2049, 5000, 40000):
        for v in (101, 4096, 49152, 151936):
            for chunk in (None, 85):
                assert head_tile(read, v, chunk) == tiling(read, v, chunk, "cpu"), (read, v, chunk)
                on_gpu = tiling(read, v, chunk, torch.device("cuda", 0))
                assert head_tile(read, v, chunk, gpu=True) == on_gpu, (read, v, chunk)
    assert head_tile(1307, 49152, gpu=True) == (1365, 49152)


def test_the_object_store_is_sized_for_what_the_run_puts_there():
    from slime_async.config.memory_plan import OBJECT_STORE_FLOOR, RunShape, object_store_bytes

    n = param_count(SMOLLM2)
    plain = RunShape(spec=SMOLLM2, bf16=True)
    assert object_store_bytes(plain) == OBJECT_STORE_FLOOR  # batches and log-probs only
    role = dataclasses.replace(plain, role_versions=5)
    assert object_store_bytes(role) == 2 * 2 * n  # two bf16 versions, when no memory file
    lora = dataclasses.replace(role, adapter_params=1000)
    assert object_store_bytes(lora) == OBJECT_STORE_FLOOR  # adapters are small


def _need(*argv: str) -> int:
    return sum(memory_parts(_cfg(*ASYNC, *argv, memory=None)).values())


def _limit_gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.4f}"


def test_a_cpu_trainer_gets_the_fastest_micro_batch_that_fits_its_memory_limit():
    """`MICRO_BATCHES` in order: 2048 tokens without recompute where it fits, then 2048 with
    full recompute (faster than a smaller budget without, and leaner), then smaller budgets
    with recompute; each derived with the numbers."""
    rc = ("--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "1")  # fmt: skip
    roomy = _cfg(*ASYNC, memory=64 * GIB)
    assert roomy.trainer.use_dynamic_batch_size
    assert (roomy.trainer.max_tokens_per_gpu, roomy.trainer.recompute_granularity) == (2048, None)
    assert "fits" in roomy.derived["--max-tokens-per-gpu"].why
    budget = ("--use-dynamic-batch-size", "--max-tokens-per-gpu")
    need = {(t, r): _need(*budget, str(t), *(rc if r else ())) for t, r in MICRO_BATCHES[:3]}
    assert need[2048, False] > need[2048, True] > need[1024, True]  # activations are counted
    for lower, upper, want in (
        ((2048, True), (2048, False), (2048, "full")),
        ((1024, True), (2048, True), (1024, "full")),
    ):
        between = _limit_gib((need[lower] + need[upper]) // 2)
        cfg = _cfg(*ASYNC, "--memory-limit-gib", between, memory=64 * GIB)
        assert (cfg.trainer.max_tokens_per_gpu, cfg.trainer.recompute_granularity) == want
        assert cfg.memory_limit_gib == float(between)
        assert "recompute" in cfg.derived["--max-tokens-per-gpu"].why


def test_a_run_that_fits_nowhere_is_refused_without_the_fixes_the_plan_already_tried():
    leanest = _need("--use-dynamic-batch-size", "--max-tokens-per-gpu",
                    str(MICRO_BATCHES[-1][0]), "--recompute-granularity", "full",
                    "--recompute-method", "uniform", "--recompute-num-layers", "1")  # fmt: skip
    with pytest.raises(ValueError, match="would not fit") as e:
        _cfg(*ASYNC, "--memory-limit-gib", _limit_gib(leanest // 2), memory=64 * GIB)
    fix = str(e.value).split("Fix: ", 1)[1]
    assert "--recompute-granularity" not in fix and "--max-tokens-per-gpu" not in fix, fix
    assert "--memory-limit-gib" in fix


def test_a_given_micro_batch_is_kept_and_refused_with_the_numbers_when_it_cannot_fit():
    given = ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096")
    cfg = _cfg(*ASYNC, *given, memory=64 * GIB)
    assert cfg.trainer.max_tokens_per_gpu == 4096 and "--max-tokens-per-gpu" not in cfg.derived
    small = _limit_gib(_need(*given, "--behavior-forward", "trainer") - GIB)
    with pytest.raises(ValueError, match=r"would not fit .* GiB of .*--max-tokens-per-gpu"):
        _cfg(*ASYNC, *given, "--memory-limit-gib", small, memory=64 * GIB)


def test_a_gpu_trainer_trains_bf16_and_is_checked_against_its_gpu():
    env = Environment(
        model=SMOLLM2, cpus=(0, 1), memory_bytes=8 * GIB, gpu_memory_bytes=(80 * GIB,)
    )
    cfg = validate(build_parser().parse_args(list(ASYNC)), env)
    assert cfg.trainer.bf16 and "GPUs" in cfg.derived["--bf16"].why
    host = memory_parts(cfg, trainer_on_gpu=True)
    assert host["trainer"] == RUNTIME["trainer"]  # its model state is on the GPU, not in RAM
    assert "--max-tokens-per-gpu" not in cfg.derived  # micro-batches are derived for CPUs only
    small = dataclasses.replace(env, gpu_memory_bytes=(1 * GIB,))
    with pytest.raises(ValueError, match=r"would not fit on its GPU: .* GiB"):
        validate(build_parser().parse_args(list(ASYNC)), small)
    cpu_env = dataclasses.replace(env, gpu_memory_bytes=(), memory_bytes=64 * GIB)
    cpu = validate(build_parser().parse_args(list(ASYNC)), cpu_env)
    assert not cpu.trainer.bf16  # no CPU bf16 feature in this environment


_MEASURE = r"""
import json, sys, threading, time
import torch
torch.set_num_threads(1)
from slime_async.contracts.model import ModelSpec
from slime_async.trainer.config import TrainerConfig
from slime_async.trainer.testing import random_batch
from slime_async.trainer.trainer import MegatronTrainer

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

peak = [0]
def sample():
    while True:
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)

args = json.loads(sys.argv[1])
spec = ModelSpec.from_dict(args["spec"])
cfg = TrainerConfig(lr=1e-6, seed=0, bf16=False, use_dynamic_batch_size=True,
                    max_tokens_per_gpu=args["tokens"])
import megatron.core.distributed, megatron.core.models.gpt, megatron.core.optimizer  # runtime
warm = MegatronTrainer(cfg, ModelSpec(**{**args["spec"], "num_layers": 1, "vocab_size": 64}))
del warm
before = rss()  # the runtime (imports, process groups) is in, no model yet
tr = MegatronTrainer(cfg, spec)
n = args["tokens"] // 128
b = random_batch(spec, batch=n, width=128, prompt=16, seed=1)
tr.train_step(b)  # Adam's moments exist from here on
static = rss()
threading.Thread(target=sample, daemon=True).start()
time.sleep(0.05)
peak[0] = 0
tr.train_step(b)
print("RESULT " + json.dumps({"state": static - before, "transient": peak[0] - static,
                              "tokens": n * 128}))
"""


def test_the_plan_predicts_a_real_train_steps_memory():
    """A real (small) trainer in a fresh process, glibc's mmap threshold fixed so freed tensors
    leave the process: its model state within 15% of `trainer_state_bytes` and the step's
    transient peak within 15% of `activation_bytes` (the allocator's slack is measured apart,
    docs/cpu.md#memory)."""
    import json
    import os
    import subprocess
    import sys

    from slime_async.config.memory_plan import RunShape, activation_bytes, trainer_state_bytes

    spec = ModelSpec(family="llama", vocab_size=16384, hidden_size=512, num_layers=6,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                     intermediate_size=1536, tie_word_embeddings=True)  # fmt: skip
    arg = json.dumps({"spec": spec.to_dict(), "tokens": 1024})
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", _MEASURE, arg], capture_output=True, text=True,
                       env=env, timeout=300, check=False)  # fmt: skip
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stderr[-3000:]
    got = json.loads(line[0][len("RESULT ") :])
    state = trainer_state_bytes(RunShape(spec=spec))
    act = activation_bytes(spec, got["tokens"], bf16=False)
    assert 0.85 < got["state"] / state < 1.15, (got, state)
    assert 0.85 < got["transient"] / act < 1.15, (got, act)


_MEASURE_GPU = r"""
import json, sys
import torch
from slime_async.contracts.model import ModelSpec
from slime_async.trainer.config import TrainerConfig
from slime_async.trainer.testing import random_batch
from slime_async.trainer.trainer import MegatronTrainer

args = json.loads(sys.argv[1])
spec = ModelSpec.from_dict(args["spec"])
rc = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
cfg = TrainerConfig(lr=1e-6, seed=0, bf16=True, use_dynamic_batch_size=True,
                    max_tokens_per_gpu=4096, **(rc if args["recompute"] else {}))
tr = MegatronTrainer(cfg, spec)
b = random_batch(spec, batch=len(args["lengths"]), width=max(args["lengths"]),
                 prompt=args["prompt"], seed=1, lengths=args["lengths"])
tr.train_step(b)  # Adam's moments exist from here on
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
tr.train_step(b)
torch.cuda.synchronize()
print("RESULT " + json.dumps({"peak": torch.cuda.max_memory_allocated()}))
"""


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("recompute", [False, True])
def test_the_plan_predicts_a_gpu_trainers_peak(recompute):
    """A bf16 SmolLM2-shaped trainer on CUDA (a fresh process: NCCL with one rank), one
    micro-batch of 40 recipe-like samples: `torch.cuda.max_memory_allocated` over its second
    step within 15% of `gpu_trainer_bytes` (model state, activations, the GPU's
    whole-vocabulary head chunks), with and without full recompute."""
    import json
    import subprocess
    import sys

    from slime_async.config.memory_plan import Recompute, RunShape, gpu_trainer_bytes

    lengths, prompt = [60 + (i * 13) % 41 for i in range(40)], 40
    arg = json.dumps(
        {"spec": SMOLLM2.to_dict(), "lengths": lengths, "prompt": prompt, "recompute": recompute}
    )
    p = subprocess.run([sys.executable, "-c", _MEASURE_GPU, arg], capture_output=True,
                       text=True, timeout=280, check=False)  # fmt: skip
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stderr[-3000:]
    peak = json.loads(line[0][len("RESULT ") :])["peak"]
    shape = RunShape(
        spec=SMOLLM2,
        bf16=True,
        trainer_on_gpu=True,
        micro_batch_tokens=sum(lengths),
        head_tokens=sum(n - prompt for n in lengths),
        recompute=Recompute() if recompute else None,
    )
    assert 0.85 <= gpu_trainer_bytes(shape) / peak <= 1.15, (gpu_trainer_bytes(shape), peak)


@pytest.mark.timeout(600)
def test_the_plan_predicts_a_whole_tiny_runs_peak(tmp_path):
    """The embedded default run (no warm start, 8 steps) as a child process, its whole process
    tree's PSS summed every half second: the plan's total for the same flags within 0.75-1.30
    of the peak. The band is wide for two reasons: PSS divides a shared library's pages among
    every process on the node that maps it (other tests' processes lower this run's share), and
    sampling can miss a short peak."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    from slime_async.config import parse_config

    argv = ["--run-dir", str(tmp_path / "run"), "--warmstart-steps", "0", "--num-steps", "8"]
    planned = sum(memory_parts(parse_config(argv)).values())
    root = Path(__file__).resolve().parents[1]
    child = subprocess.Popen(
        [sys.executable, str(root / "train_async.py"), *argv],
        cwd=root,
        env={**os.environ, "RAY_ADDRESS": "local"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    peak = 0
    try:
        while child.poll() is None:
            total = 0
            try:
                procs = [psutil.Process(child.pid), *psutil.Process(child.pid).children(True)]
            except psutil.NoSuchProcess:
                break
            for p in procs:
                try:
                    total += p.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            peak = max(peak, total)
            time.sleep(0.5)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, 9)
        child.wait()
    assert child.returncode == 0
    print(f"plan {planned / GIB:.2f} GiB, peak PSS {peak / GIB:.2f} GiB: {planned / peak:.2f}")
    assert 0.75 < planned / peak < 1.30, (planned / GIB, peak / GIB)
