"""`TrainerConfig`: the trainer component's one frozen config, and its argparse group.

Owns: every trainer knob (parallel layout, optimizer, LR schedule, micro-batching, routing
replay, snapshots, checkpoint paths). Must never import the controller, engine, rollout or
data-worker parts of `slime_async`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
from typing import Any, Literal

from clifields import add_flags, check_ranges, flag, from_args
from loss import LossSelection
from slime_async.contracts.adapter import PEFT_MODULES, parse_targets
from slime_async.trainer.replay import RoutingReplay


def _check_layout_fields(c: TrainerConfig) -> None:
    """Micro-batching, packing, recompute and interleaving settings (ValueError with the fix)."""
    if c.qkv_format not in ("thd", "bshd"):
        raise ValueError(f"qkv_format={c.qkv_format!r}; use 'thd' (packed) or 'bshd' (padded)")
    if c.use_dynamic_batch_size and not c.max_tokens_per_gpu:
        raise ValueError(
            "--use-dynamic-batch-size needs --max-tokens-per-gpu N (tokens per micro-batch)"
        )
    if c.max_tokens_per_gpu is not None and not c.use_dynamic_batch_size:
        raise ValueError(
            "--max-tokens-per-gpu is the budget of --use-dynamic-batch-size; add that flag "
            "(or drop --max-tokens-per-gpu to keep --micro-batch-size samples per micro-batch)"
        )
    vp = c.virtual_pipeline_model_parallel_size
    if vp is not None and (vp < 2 or c.pipeline_model_parallel_size < 2):
        raise ValueError(
            f"--num-virtual-stages-per-pipeline-rank {vp} needs a value >= 2 and "
            f"--pipeline-model-parallel-size >= 2 (got {c.pipeline_model_parallel_size}); "
            "drop it for the plain 1F1B schedule"
        )
    g, m, n = c.recompute_granularity, c.recompute_method, c.recompute_num_layers
    if g not in (None, "full", "selective"):
        raise ValueError(f"recompute_granularity={g!r}; use 'full' or 'selective'")
    if g == "full" and (m not in ("uniform", "block") or not n or n < 1):
        raise ValueError(
            "--recompute-granularity full needs --recompute-method uniform|block and "
            "--recompute-num-layers N >= 1"
        )
    if g != "full" and (m is not None or n is not None):
        raise ValueError(
            "--recompute-method/--recompute-num-layers apply to --recompute-granularity full only"
        )


def _env_vars(text: str) -> str:
    """`--train-env-vars`: a JSON object of string values (kept as its text, so config.json
    replays it)."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e})") from None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise argparse.ArgumentTypeError(
            f'{text!r} must be a JSON object of strings, e.g. \'{{"NCCL_ALGO": "Ring"}}\''
        )
    return text


def check_world(c: TrainerConfig) -> None:
    """Ranks (nodes x GPUs per node) against megatron's two layouts (ValueError): TP x PP x DP
    for the dense layers, ETP x EP x PP x expert-DP for the experts. Checked for
    `train_async.py`'s flags; a `TrainerGroup` built directly gives its own world size."""
    world, tp, pp = c.world_size, c.tensor_model_parallel_size, c.pipeline_model_parallel_size
    ep, etp = c.expert_model_parallel_size, c.expert_tensor_parallel
    ranks = (
        f"{world} trainer ranks (--actor-num-nodes {c.actor_num_nodes} x "
        f"--actor-num-gpus-per-node {c.actor_num_gpus_per_node})"
    )
    if world % (tp * pp):
        raise ValueError(
            f"{ranks} do not split into TP {tp} x PP {pp} x DP; make the rank count a "
            "multiple of TP x PP (or change the parallel sizes)"
        )
    if world % (etp * ep * pp):
        given = (
            f"--expert-tensor-parallel-size {etp}"
            if c.expert_tensor_parallel_size is not None
            else f"ETP {etp} (--expert-tensor-parallel-size, default: TP)"
        )
        raise ValueError(
            f"{ranks} do not split into {given} x EP {ep} x PP {pp} x the experts' DP "
            "(Megatron's rule for the expert layers); make the rank count a multiple of "
            "ETP x EP x PP (or lower --expert-model-parallel-size / "
            "--expert-tensor-parallel-size)"
        )


_EMBEDDED_RUN_VALUES: dict[str, Any] = {
    "micro_batch_size": 16,
    "routing_replay": RoutingReplay.R3,
    "keep_old_actor": True,
}
"""The fields `EMBEDDED_RUN` sets (see there)."""

REAL_MODEL_LR = 1e-6
"""`--lr` of a run with --hf-checkpoint/--prompt-data/--prompt-source when the user gives none:
RL on a pretrained model takes ~1e-6 (the embedded default's 1e-4 collapses a 135M model's
entropy within a few steps)."""
REAL_MODEL_LR_WARN = 2e-5
"""A user `--lr` above this on a pretrained model is warned about at start-up."""


def _shown(value: Any) -> str:
    """A value as `--help` writes it (on/off for a switch)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, enum.Enum):
        return str(value.value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _by_run_kind(default: Any, *, embedded: Any = None, user: Any = None, **spec: Any) -> Any:
    """`flag(default, derived=...)` of a field whose default depends on the run kind (set by
    `slime_async.config`): `embedded` for the embedded default run, `user` for a run with a
    user's model or data (None: `default`)."""
    emb = default if embedded is None else embedded
    usr = default if user is None else user
    rule = (
        f"{_shown(emb)} for the embedded default run, {_shown(usr)} with "
        "--hf-checkpoint/--prompt-data/--prompt-source"
    )
    return flag(default, derived=rule, **spec)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    """Configuration of one Megatron trainer group (every rank gets the same object)."""

    tensor_model_parallel_size: int = flag(1, ge=1, hint="1 = no such parallelism")
    """Tensor-parallel size; with TP > 1 sequence parallelism is on (MoE + TP requires it).
    TP=2 on 4 ranks: DP=2 x TP=2. See docs/parallelism.md."""
    expert_model_parallel_size: int = flag(1, ge=1, hint="1 = no such parallelism")
    """Expert-parallel size (experts split across ranks); ETP x EP x PP must divide the rank
    count (Megatron's rule). EP=2 on 2 ranks: DP=2, experts split in two."""
    expert_tensor_parallel_size: int | None = flag(None, ge=1)
    """Megatron's tensor parallelism of the routed experts, apart from the dense layers'
    (default: --tensor-model-parallel-size). TP 2, ETP 1, EP 2 on 2 ranks: attention split in
    two, each rank holds half the experts whole."""
    pipeline_model_parallel_size: int = flag(1, ge=1, hint="1 = no such parallelism")
    """Pipeline-parallel size: layers split evenly, megatron's 1F1B schedule. PP=2 on 4 ranks:
    DP=2 x PP=2."""
    virtual_pipeline_model_parallel_size: int | None = flag(
        None, name="num-virtual-stages-per-pipeline-rank"
    )
    """Model chunks per pipeline rank: megatron's interleaved 1F1B schedule (needs PP >= 2,
    layers divisible by PP x this, micro-batches a multiple of PP); unset: not interleaved."""
    actor_num_nodes: int = flag(1, ge=1)
    """Nodes the trainer ranks span (slime's name); ranks = this x --actor-num-gpus-per-node =
    TP x PP x DP. See docs/cluster.md."""
    actor_num_gpus_per_node: int = flag(1, ge=1)
    """Trainer ranks per node, one GPU each (slime's name); on a cluster without GPUs each rank
    reserves --actor-num-cpus-per-rank CPUs instead."""
    actor_num_cpus_per_rank: float = flag(1.0, ge=0)
    """Logical Ray CPUs each trainer rank reserves in its placement-group bundle."""
    micro_batch_size: int = _by_run_kind(4, embedded=_EMBEDDED_RUN_VALUES["micro_batch_size"], ge=1)
    """Samples per forward/backward micro-batch per data-parallel rank; ignored in favour of the
    token budget with --use-dynamic-batch-size."""
    use_dynamic_batch_size: bool = False
    """Micro-batches of at most --max-tokens-per-gpu tokens instead of a fixed sample count
    (longest samples first, balanced; every DP rank runs the same number of micro-batches)."""
    max_tokens_per_gpu: int | None = flag(None, ge=1)
    """Token budget of one micro-batch per rank (with --use-dynamic-batch-size); a longer sample
    gets a micro-batch of its own."""
    qkv_format: Literal["thd", "bshd"] = "thd"
    """thd: each micro-batch's samples packed into one row (cu_seqlens: no padding, no attention
    across samples, positions restart per sample); bshd: padded to [b, s] (for debugging)."""
    use_distributed_optimizer: bool | None = None
    """Shard Adam state and fp32 main parameters over data-parallel ranks (megatron's
    DistributedOptimizer) (default: on when DP > 1)."""
    bf16: bool = flag(
        False,
        derived="on for a run with --hf-checkpoint/--prompt-data/--prompt-source when the CPU "
        "has AMX or AVX512_BF16, off otherwise",
    )
    """bf16 parameters and activations, fp32 main parameters in the optimizer and fp32
    gradient accumulation (megatron's --bf16). See docs/cpu.md."""
    cpu_fused_kernels: bool = flag(
        False,
        derived="on for a run with --hf-checkpoint/--prompt-data/--prompt-source whose trainer "
        "runs on CPUs where a C++ compiler is found, off otherwise",
    )
    """A CPU trainer's RMSNorm, SwiGLU and rotary embedding as fused kernels compiled by torch's
    Inductor (trainer/fused.py): fewer passes over the activations, for a C++ compiler at run
    time, seconds of compiling at each process's first step and Inductor's memory. See
    docs/cpu.md#fused-kernels."""
    logits_chunk_tokens: int | None = flag(None, ge=0, hint="0 = the whole [tokens, vocab] tensor")
    """Tokens per chunk of the log-prob/entropy head (fp32 logits of one chunk by a block of the
    vocabulary at once, the backward recomputing them tile by tile; `lm_head.tiling`); unset:
    up to 2048 on a CPU, as many as fit 256 MiB of whole-vocabulary logits on a GPU. See
    docs/performance.md."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recomputation in the backward (megatron): full layers or selective (core
    attention). Works with routing replay (replayed in the recompute too)."""
    recompute_method: Literal["uniform", "block"] | None = None
    """With --recompute-granularity full: uniform (groups of --recompute-num-layers) or block
    (the first --recompute-num-layers layers of each stage)."""
    recompute_num_layers: int | None = None
    """With --recompute-granularity full: layers per recomputed group (uniform) or recomputed
    layers per stage (block)."""
    lr: float = _by_run_kind(1e-4, user=REAL_MODEL_LR, ge=0, lt=math.inf)
    """Peak learning rate (a pretrained model takes a far lower one)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of the warmup (megatron's schedule)."""
    lr_warmup_steps: int = flag(0, name="lr-warmup-iters", ge=0, hint="0 = no warmup")
    """Linear warmup steps from --lr-warmup-init to --lr (slime's name; megatron's schedule:
    update k uses the LR at step k, so the first update of a warmup uses --lr-warmup-init)."""
    lr_decay_steps: int | None = flag(
        None,
        name="lr-decay-iters",
        ge=0,
        derived="the run's train steps (--num-steps) for linear/cosine, as in slime",
    )
    """Steps over which the LR decays to --min-lr (slime's name; unset: constant after
    warmup)."""
    lr_warmup_fraction: float | None = flag(None, ge=0, lt=1)
    """Megatron's/slime's warmup as a fraction of --lr-decay-iters (of the run's train steps
    under a constant LR): derives --lr-warmup-iters, rounded to whole steps."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """LR decay shape."""
    weight_decay: float = flag(0.0, ge=0, lt=math.inf)
    """Decoupled (AdamW) weight decay; megatron applies none to norms and biases."""
    adam_beta1: float = flag(0.9, ge=0, lt=1, hint="e.g. 0.9 / 0.98")
    """AdamW β1."""
    adam_beta2: float = flag(0.98, ge=0, lt=1, hint="e.g. 0.9 / 0.98")
    """AdamW β2."""
    adam_eps: float = flag(1e-8, gt=0, lt=math.inf, hint="e.g. 1e-8")
    """AdamW ε."""
    clip_grad: float = flag(1.0, ge=0, lt=math.inf, hint="0 = off")
    """Global gradient-norm clip (0 disables clipping)."""
    use_rollout_logprobs: bool = False
    """slime's: the loss's old policy π_old is the engine's log-probs of the sampled tokens
    (π_j^SGL) instead of the trainer's (π_k), so PPO's ratio π_θ/π_old carries the engine
    mismatch and the staleness; refused with CompIS, which corrects both separately from π_j^Meg
    (slime refuses it with --use-tis, CompIS's engine correction here)."""
    train_env_vars: str | None = flag(None, parse=_env_vars, metavar="JSON")
    """slime's: environment variables of the trainer's processes, a JSON object of strings
    ('{"NCCL_ALGO": "Ring"}'), set through Ray's runtime_env (Ray workers on a joined cluster
    do not inherit the driver's environment)."""
    deterministic_mode: bool = False
    """Megatron's and slime's deterministic mode: every trainer process runs PyTorch's
    deterministic algorithms (`torch.use_deterministic_algorithms`; on CUDA with cuBLAS's
    fixed workspace), so a train step repeats bit for bit given the same batch and seed;
    slower on GPUs."""
    seed: int = flag(1234, ge=0, cli=False)
    """Seed of model init and megatron's RNG tracker: the run's --seed (`RunConfig.seed`, which
    also seeds data order, sampling and the engines)."""
    routing_replay: RoutingReplay = _by_run_kind(  # noqa: RUF009 (a field, like flag())
        RoutingReplay.NONE, embedded=_EMBEDDED_RUN_VALUES["routing_replay"]
    )
    """MoE routing replay: none, r2 (the trainer records its routing in the step's first forward
    and replays it), r3 (the engine's routing, replayed in every forward; slime's
    --use-rollout-routing-replay)."""
    keep_old_actor: bool = _by_run_kind(False, embedded=_EMBEDDED_RUN_VALUES["keep_old_actor"])
    """Keep CPU snapshots of past versions' weights to compute π_j^Meg (CompIS's r2/r3 split;
    off: the combined ratio). Kept by default only for a loss that reads π_j^Meg."""
    max_snapshots: int = flag(
        2,
        derived="the worst-case staleness + 1, which every kept version needs",
        ge=1,
        hint="--no-keep-old-actor keeps none",
    )
    """Most version snapshots kept in CPU memory; the oldest are evicted."""
    behavior_forward: Literal["trainer", "role"] = flag(
        "trainer", derived="role for an async run whose loss reads π_j^Meg, trainer otherwise"
    )
    """Where π_j^Meg is computed with --keep-old-actor: "trainer" (the train step swaps in each
    version's snapshot, on the critical path) or "role" (a forward-only role, on the rollout
    cores, computes each sample's log-probs under its versions' weights when the sample
    completes, off the trainer's path; the trainer then keeps no snapshots). See
    docs/compis.md."""
    temperature: float = flag(1.0, cli=False)
    """Sampling temperature the engine used (logits are divided by it); the run sets it from
    --rollout-temperature."""
    load: str | None = None
    """Checkpoint directory to resume from; must hold a checkpoint."""
    save: str | None = None
    """Checkpoint directory to save into."""
    hf_checkpoint: str | None = None
    """HF weights directory to start from (not used when --load is given)."""
    save_hf: str | None = flag(
        None, derived="<run-dir>/hf, unless --save is given with a user's model", metavar="DIR"
    )
    """Hugging Face directory the trained model is written to at every checkpoint
    (--save-interval) and at the end of the run: safetensors, config.json, and the
    --hf-checkpoint's tokenizer and generation_config.json; loadable by transformers'
    from_pretrained. DIR holds the latest export, replaced atomically. 'none': write none."""
    hf_source: str | None = flag(None, cli=False)
    """HF directory whose identity every export carries (config fields the ModelSpec does not
    model, BOS/EOS/PAD ids, tokenizer, generation config): the run's --hf-checkpoint, or its
    GGUF conversion; None: exports are built from the ModelSpec alone."""
    ref_load: str | None = None
    """Weights of the KL penalty's reference policy, with --use-kl-loss: a Hugging Face
    directory or a Megatron torch_dist checkpoint (what slime's converter writes; its newest
    iteration), told apart by what it holds (default: the run's initial weights; needed with
    --load when the loss reads π_ref)."""
    start_from: str | None = flag(None, cli=False)
    """Weights the trainer starts from instead of --hf-checkpoint's, with a fresh optimizer:
    what --load names when it holds no checkpoint of train_async.py but weights (a Megatron
    torch_dist checkpoint, e.g. slime's, or a Hugging Face directory); set by the run."""
    ckpt_format: Literal["torch_dist", "torch"] | None = flag(
        None, derived="torch_dist; torch with --lora-rank > 0"
    )
    """Checkpoint format --save writes (megatron's and slime's flag): torch_dist (each rank writes
    its own shards through megatron's dist_checkpointing, nothing gathered; any layout loads it)
    or torch (full HF-named weights and Adam moments gathered on rank 0). --load reads either.
    See docs/resume-guards.md."""
    keep_checkpoints: int = flag(2, ge=0, hint="0 = keep all")
    """Complete checkpoints kept in --save (older ones are deleted)."""
    freeze_vision_tower: bool = False
    """Vision-language models: keep the vision encoder and merger fixed (train the language
    model only, as most VL RL recipes do); the weight push still carries them unchanged. Needed
    with --tensor-model-parallel-size > 1 (the vision tower is not tensor-parallel)."""
    lora_rank: int = flag(0, ge=0, hint="0 = full fine-tuning")
    """LoRA rank r: train adapters (A [r, d_in], B [d_out, r]) on --lora-target-modules with the
    base frozen; only they are in the optimizer and in each weight push. 0: train every
    weight. See docs/lora.md."""
    lora_alpha: float = flag(16.0, gt=0, lt=math.inf)
    """LoRA scaling numerator: the update is (alpha / r) · B A (PEFT's lora_alpha)."""
    lora_dropout: float = flag(0.0, ge=0, lt=1)
    """Dropout on the adapters' input in training forwards (PEFT's lora_dropout); log-prob
    forwards never drop."""
    lora_target_modules: tuple[str, ...] = flag(PEFT_MODULES, choices=(*PEFT_MODULES, "all"))
    """Projections with an adapter (PEFT/SGLang names) or 'all', space-separated as SGLang
    spells it."""
    loss: LossSelection = flag(default_factory=LossSelection, cli=False)
    """The loss (registry name or dotted path) and its config object, from the `loss`
    package's own flags (`loss.loss_settings_from_args`)."""

    @property
    def env_vars(self) -> dict[str, str]:
        """--train-env-vars as a mapping ({} when not given)."""
        import json

        return json.loads(self.train_env_vars) if self.train_env_vars else {}

    @property
    def world_size(self) -> int:
        """Trainer ranks: `actor_num_nodes x actor_num_gpus_per_node` (= TP x PP x DP)."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def checkpoint_format(self) -> str:
        """--ckpt-format, derived when not given: torch with LoRA, torch_dist otherwise."""
        if self.ckpt_format is not None:
            return self.ckpt_format
        return "torch" if self.lora_rank > 0 else "torch_dist"

    @property
    def expert_tensor_parallel(self) -> int:
        """The experts' tensor-parallel size: --expert-tensor-parallel-size, else TP."""
        ep = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if ep is None else ep

    @property
    def data_parallel_size(self) -> int:
        """DP = ranks / (TP x PP) (of the dense layers; the experts' is ranks / (ETP x EP x
        PP))."""
        return self.world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        )

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "routing_replay", RoutingReplay(self.routing_replay))
        except ValueError:
            choices = ", ".join(m.value for m in RoutingReplay)
            raise ValueError(
                f"routing_replay={self.routing_replay!r} is not supported; use one of {choices}"
            ) from None
        check_ranges(self)
        _check_layout_fields(self)
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(
                f"lr_decay_style={self.lr_decay_style!r}; use 'constant', 'linear' or 'cosine'"
            )
        if self.lr_decay_style != "constant" and not self.lr_decay_steps:
            raise ValueError(f"lr_decay_style={self.lr_decay_style!r} needs lr_decay_steps > 0")
        if self.lr_decay_steps and self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(
                f"lr_warmup_steps={self.lr_warmup_steps} must be < lr_decay_steps="
                f"{self.lr_decay_steps} (the decay counts from step 0, warmup included)"
            )
        if not 0 <= self.lr_warmup_init <= self.lr or not 0 <= self.min_lr <= self.lr:
            raise ValueError(
                f"need 0 <= lr_warmup_init ({self.lr_warmup_init}) <= lr ({self.lr}) and "
                f"0 <= min_lr ({self.min_lr}) <= lr"
            )
        if self.behavior_forward not in ("trainer", "role"):
            raise ValueError(
                f"behavior_forward={self.behavior_forward!r}; use 'trainer' (snapshot forwards "
                "in the train step) or 'role' (a forward-only role when samples complete)"
            )
        # 'all' → every module, PEFT's order; ValueError naming an unknown one
        targets = parse_targets(",".join(self.lora_target_modules))
        object.__setattr__(self, "lora_target_modules", targets)
        if self.ckpt_format not in (None, "torch_dist", "torch"):
            raise ValueError(f"ckpt_format={self.ckpt_format!r}; use 'torch_dist' or 'torch'")
        if self.ckpt_format == "torch_dist" and self.lora_rank > 0:
            raise ValueError(
                "--ckpt-format torch_dist does not save LoRA adapters (they have no megatron "
                "sharded state); use --ckpt-format torch, the default with --lora-rank"
            )
        if not self.temperature > 0:  # set by the run (no flag of its own)
            raise ValueError("temperature must be > 0")


EMBEDDED_RUN = TrainerConfig(**_EMBEDDED_RUN_VALUES)
"""Where the embedded default run (tiny MoE on CPU, built-in tasks) differs from `TrainerConfig()`:
larger micro-batches (fewer passes are faster for a tiny model), rollout routing replay (the model
is an MoE) and version snapshots (CompIS's r2/r3 split). A run with a user model or data gets the
`TrainerConfig()` values. `slime_async.config` applies these to flags the user did not give."""


def run_kind_defaults(*, embedded: bool) -> dict[str, object]:
    """{field: value} of every field where `EMBEDDED_RUN` differs from `TrainerConfig()`, with the
    value for this run kind (their flags default to None so the run can tell them apart)."""
    base = TrainerConfig()
    pick = EMBEDDED_RUN if embedded else base
    return {
        f.name: getattr(pick, f.name)
        for f in dataclasses.fields(TrainerConfig)
        if getattr(EMBEDDED_RUN, f.name) != getattr(base, f.name)
    }


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SlimeTrainerAliases:
    """slime's trainer switches that set a `TrainerConfig` field under another name (flags only,
    never part of a config)."""

    use_rollout_routing_replay: bool = False
    """slime's name for --routing-replay r3 (refused with another --routing-replay)."""


def add_trainer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the trainer flag group: one flag per `TrainerConfig` field (slime's names where slime
    has one), plus `SlimeTrainerAliases`.

    Defaults come from `TrainerConfig`; a field the run derives (`micro_batch_size`, `lr`,
    `routing_replay`, `keep_old_actor`, `max_snapshots`, `behavior_forward`) defaults to None on
    the command line (see `slime_async.config`), which reports what it chose. `seed` is the run's
    `--seed` (`slime_async.config.run_config`); `loss` and `temperature` come from other flags.
    """
    group = add_flags(parser, TrainerConfig, group="trainer")
    add_flags(group, SlimeTrainerAliases)
    return parser


def trainer_config_from_args(args: argparse.Namespace) -> TrainerConfig:
    """Build the config from parsed flags; a flag left None takes the `TrainerConfig` default,
    and `seed` is the run's `--seed` when the parser has it.

    `--use-rollout-routing-replay` is slime's name for `--routing-replay r3`; giving it with a
    different `--routing-replay` is refused rather than letting one silently win.
    """
    given: dict[str, Any] = {}
    if getattr(args, "seed", None) is not None:
        given["seed"] = args.seed
    if from_args(SlimeTrainerAliases, args).use_rollout_routing_replay:
        chosen = getattr(args, "routing_replay", None)
        if chosen is not None and RoutingReplay(chosen) is not RoutingReplay.R3:
            raise ValueError(
                f"--use-rollout-routing-replay means --routing-replay r3, but --routing-replay "
                f"{RoutingReplay(chosen).value} was also given; keep one of the two flags"
            )
        given["routing_replay"] = RoutingReplay.R3
    cfg = from_args(TrainerConfig, args, **given)
    check_world(cfg)
    return cfg
