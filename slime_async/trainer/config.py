"""`TrainerConfig`: the trainer component's one frozen config, and its argparse group.

Owns: every trainer knob (parallel layout, optimizer, LR schedule, micro-batching, routing
replay, snapshots, checkpoint paths). Must never import the controller, engine, rollout or
data-worker parts of `slime_async`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from loss import LossSelection
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
    if c.max_tokens_per_gpu is not None and c.max_tokens_per_gpu < 1:
        raise ValueError("max_tokens_per_gpu must be >= 1")
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


def _check_ranges(c: TrainerConfig) -> None:
    """Every numeric flag in its range (ValueError naming the flag and the fix)."""
    for field, flag in (
        ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
        ("expert_model_parallel_size", "--expert-model-parallel-size"),
        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ):
        if getattr(c, field) < 1:
            raise ValueError(
                f"{flag} must be >= 1 (1 = no such parallelism), got {getattr(c, field)}"
            )
    if c.lr_warmup_steps < 0:
        raise ValueError(f"--lr-warmup-iters must be >= 0 (0 = no warmup), got {c.lr_warmup_steps}")
    if not (math.isfinite(c.weight_decay) and c.weight_decay >= 0):
        raise ValueError(f"--weight-decay must be a finite number >= 0, got {c.weight_decay}")
    for field, flag in (("adam_beta1", "--adam-beta1"), ("adam_beta2", "--adam-beta2")):
        v = getattr(c, field)
        if not 0 <= v < 1:
            raise ValueError(f"{flag} must be in [0, 1) (e.g. 0.9 / 0.98), got {v}")
    if not (math.isfinite(c.adam_eps) and c.adam_eps > 0):
        raise ValueError(f"--adam-eps must be a finite number > 0 (e.g. 1e-8), got {c.adam_eps}")
    if not (math.isfinite(c.clip_grad) and c.clip_grad >= 0):
        raise ValueError(f"--clip-grad must be a finite number >= 0 (0 = off), got {c.clip_grad}")
    if c.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {c.seed}")
    if c.keep_checkpoints < 0:
        raise ValueError(
            f"--keep-checkpoints must be >= 0 (0 = keep all), got {c.keep_checkpoints}"
        )
    if c.lr_decay_steps is not None and c.lr_decay_steps < 0:
        raise ValueError(f"--lr-decay-iters must be >= 0, got {c.lr_decay_steps}")


def check_world(c: TrainerConfig) -> None:
    """Ranks (nodes x GPUs per node) against TP x PP x DP with EP inside DP (ValueError).
    Checked for `train_async.py`'s flags; a `TrainerGroup` built directly gives its own
    world size."""
    if c.actor_num_nodes < 1 or c.actor_num_gpus_per_node < 1:
        raise ValueError(
            f"--actor-num-nodes ({c.actor_num_nodes}) and --actor-num-gpus-per-node "
            f"({c.actor_num_gpus_per_node}) must be >= 1"
        )
    if c.actor_num_cpus_per_rank < 0:
        raise ValueError(f"--actor-num-cpus-per-rank must be >= 0, got {c.actor_num_cpus_per_rank}")
    world, tp, pp = c.world_size, c.tensor_model_parallel_size, c.pipeline_model_parallel_size
    ep = c.expert_model_parallel_size
    if tp < 1 or pp < 1 or ep < 1 or world % (tp * pp) or (world // (tp * pp)) % ep:
        raise ValueError(
            f"{world} trainer ranks (--actor-num-nodes {c.actor_num_nodes} x "
            f"--actor-num-gpus-per-node {c.actor_num_gpus_per_node}) do not split into "
            f"TP {tp} x PP {pp} x DP with EP {ep} dividing DP; make the rank count a multiple "
            "of TP x PP x EP (or change the parallel sizes)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    """Configuration of one Megatron trainer group (every rank gets the same object)."""

    tensor_model_parallel_size: int = 1
    """TP size; with TP > 1 sequence parallelism is on (MoE + TP requires it)."""
    expert_model_parallel_size: int = 1
    """EP size (experts split across ranks)."""
    pipeline_model_parallel_size: int = 1
    """PP size (layers split evenly; megatron's 1F1B schedule)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (megatron's interleaved 1F1B); None: not interleaved."""
    actor_num_nodes: int = 1
    """Nodes the trainer ranks span (slime's `--actor-num-nodes`)."""
    actor_num_gpus_per_node: int = 1
    """Trainer ranks per node, one GPU each (slime's `--actor-num-gpus-per-node`); on a
    cluster without GPUs each rank takes `actor_num_cpus_per_rank` CPUs instead."""
    actor_num_cpus_per_rank: float = 1.0
    """Logical CPUs each trainer rank reserves in its placement-group bundle."""
    micro_batch_size: int = 4
    """Samples per forward/backward micro-batch (per data-parallel rank), unless
    `use_dynamic_batch_size`."""
    use_dynamic_batch_size: bool = False
    """Fill micro-batches up to `max_tokens_per_gpu` tokens instead of a fixed sample count."""
    max_tokens_per_gpu: int | None = None
    """Token budget of one micro-batch per rank (with `use_dynamic_batch_size`)."""
    qkv_format: str = "thd"
    """'thd': samples packed into one row per micro-batch (no padding); 'bshd': padded [b, s]."""
    use_distributed_optimizer: bool | None = None
    """Shard optimizer state over DP (megatron's DistributedOptimizer); None: on when DP > 1."""
    bf16: bool = False
    """bf16 parameters and activations with fp32 main parameters in the optimizer."""
    recompute_granularity: str | None = None
    """Activation recomputation: 'full' (whole layers) or 'selective' (core attention)."""
    recompute_method: str | None = None
    """With 'full': 'uniform' or 'block' (megatron's meaning)."""
    recompute_num_layers: int | None = None
    """With 'full': layers per recomputed group ('uniform') or recomputed layers ('block')."""
    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of the warmup."""
    lr_warmup_steps: int = 0
    """Linear warmup steps from `lr_warmup_init` to `lr` (megatron's schedule: update k uses
    the LR at step k, so the first update of a warmup uses `lr_warmup_init`)."""
    lr_decay_steps: int | None = None
    """Steps over which the LR decays to `min_lr` (None: constant after warmup)."""
    lr_decay_style: str = "constant"
    """'constant', 'linear' or 'cosine'."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay; megatron applies none to norms and biases."""
    adam_beta1: float = 0.9
    """AdamW β1."""
    adam_beta2: float = 0.98
    """AdamW β2."""
    adam_eps: float = 1e-8
    """AdamW ε."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables clipping)."""
    seed: int = 1234
    """Seed of model init and megatron's RNG tracker."""
    routing_replay: RoutingReplay = RoutingReplay.NONE
    """MoE routing replay: none, r2 (trainer's own), r3 (engine's)."""
    keep_old_actor: bool = False
    """Keep CPU snapshots of past versions to compute π_j^Meg (CompIS r2/r3 split)."""
    max_snapshots: int = 2
    """Most version snapshots kept (a run sets worst-case staleness + 1); oldest are evicted."""
    behavior_forward: str = "trainer"
    """Where π_j^Meg is computed when the loss reads it: "trainer" (the train step swaps in
    each version's snapshot, on the critical path) or "role" (a forward-only role computes
    each sample's log-probs under its versions' weights when the sample completes, off the
    trainer's path; the trainer then keeps no snapshots). See docs/compis.md."""
    temperature: float = 1.0
    """Sampling temperature the engine used (logits are divided by it)."""
    load: str | None = None
    """Checkpoint directory to resume from (`--load`); must hold a checkpoint."""
    save: str | None = None
    """Checkpoint directory to save into (`--save`)."""
    hf_checkpoint: str | None = None
    """HF directory to start from when not resuming (`--hf-checkpoint`)."""
    ref_load: str | None = None
    """HF directory of the KL penalty's reference policy (`--ref-load`); None: the run's initial
    weights. Needed with `--load` when the loss reads π_ref."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept in `save` (older ones are deleted)."""
    loss: LossSelection = dataclasses.field(default_factory=LossSelection)
    """The loss (registry name or dotted path) and its config object, from the `loss`
    package's own flags (`loss.loss_settings_from_args`)."""

    @property
    def world_size(self) -> int:
        """Trainer ranks: `actor_num_nodes x actor_num_gpus_per_node` (= TP x PP x DP)."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        """DP = ranks / (TP x PP); EP splits experts inside it."""
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
        if self.micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        _check_ranges(self)
        _check_layout_fields(self)
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"lr={self.lr} must be a finite number >= 0")
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
        if self.max_snapshots < 1:
            raise ValueError("max_snapshots must be >= 1 (use keep_old_actor=False to disable)")
        if self.clip_grad < 0:
            raise ValueError("clip_grad must be >= 0 (0 disables clipping)")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")


EMBEDDED_RUN = TrainerConfig(
    micro_batch_size=16, routing_replay=RoutingReplay.R3, keep_old_actor=True
)
"""Where the embedded default run (tiny MoE on CPU, built-in tasks) differs from `TrainerConfig()`:
larger micro-batches (fewer passes are faster for a tiny model), rollout routing replay (the model
is an MoE) and version snapshots (CompIS's r2/r3 split). A run with a user model or data gets the
`TrainerConfig()` values. `slime_async.config` applies these to flags the user did not give."""


REAL_MODEL_LR = 1e-6
"""`--lr` of a run with --hf-checkpoint/--prompt-data/--prompt-source when the user gives none:
RL on a pretrained model takes ~1e-6 (the embedded default's 1e-4 collapses a 135M model's
entropy within a few steps)."""
REAL_MODEL_LR_WARN = 2e-5
"""A user `--lr` above this on a pretrained model is warned about at start-up."""


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


def add_trainer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the trainer flag group (slime-compatible names where slime has one).

    Every default is read from `TrainerConfig()`. `--micro-batch-size`, `--routing-replay`,
    `--keep-old-actor` and `--max-snapshots` default to None: the run derives them (see
    `slime_async.config`) and reports what it chose.
    """
    g = parser.add_argument_group("trainer")
    d = TrainerConfig()
    _add_parallel_args(g, d)
    _add_batching_args(g, d)
    _add_optimizer_args(g, d)
    _add_off_policy_args(g, d)
    _add_checkpoint_args(g, d)
    return parser


def _add_parallel_args(g: argparse._ArgumentGroup, d: TrainerConfig) -> None:
    g.add_argument(
        "--actor-num-nodes",
        type=int,
        default=d.actor_num_nodes,
        help="Nodes of the trainer ranks (slime's name); ranks = this x "
        "--actor-num-gpus-per-node = TP x PP x DP. See docs/cluster.md.",
    )
    g.add_argument(
        "--actor-num-gpus-per-node",
        type=int,
        default=d.actor_num_gpus_per_node,
        help="Trainer ranks per node, one GPU each (slime's name); on a cluster without GPUs "
        "each rank reserves --actor-num-cpus-per-rank CPUs instead.",
    )
    g.add_argument(
        "--actor-num-cpus-per-rank",
        type=float,
        default=d.actor_num_cpus_per_rank,
        help="Logical Ray CPUs each trainer rank reserves in its placement-group bundle.",
    )
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=d.tensor_model_parallel_size,
        help="Tensor-parallel size; sequence parallelism is on with it (TP=2 on 4 ranks: "
        "DP=2 x TP=2). See docs/parallelism.md.",
    )
    g.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=d.expert_model_parallel_size,
        help="Expert-parallel size; must divide the data-parallel size (EP=2 on 2 ranks: "
        "DP=2, experts split in two).",
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=d.pipeline_model_parallel_size,
        help="Pipeline-parallel size: layers split evenly, megatron's 1F1B schedule (PP=2 on "
        "4 ranks: DP=2 x PP=2).",
    )
    g.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        dest="virtual_pipeline_model_parallel_size",
        type=int,
        default=d.virtual_pipeline_model_parallel_size,
        help="Model chunks per pipeline rank: megatron's interleaved 1F1B schedule (needs "
        "PP >= 2, layers divisible by PP x this, micro-batches a multiple of PP).",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=d.use_distributed_optimizer,
        help="Shard Adam state and fp32 main parameters over data-parallel ranks (megatron's "
        "DistributedOptimizer; default: on when DP > 1).",
    )
    g.add_argument(
        "--bf16",
        action="store_true",
        default=d.bf16,
        help="bf16 parameters and activations, fp32 main parameters in the optimizer.",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=d.recompute_granularity,
        help="Activation recomputation in the backward (megatron): full layers or selective "
        "(core attention). Works with routing replay (replayed in the recompute too).",
    )
    g.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=d.recompute_method,
        help="With --recompute-granularity full: uniform (groups of --recompute-num-layers) "
        "or block (the first --recompute-num-layers layers of each stage).",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=d.recompute_num_layers,
        help="Layers per group (uniform) or recomputed layers per stage (block).",
    )


def _add_batching_args(g: argparse._ArgumentGroup, d: TrainerConfig) -> None:
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="Samples per micro-batch per data-parallel rank (default: "
        f"{EMBEDDED_RUN.micro_batch_size} for the embedded default run, "
        f"{d.micro_batch_size} otherwise); ignored in favour of the token budget with "
        "--use-dynamic-batch-size.",
    )
    g.add_argument(
        "--use-dynamic-batch-size",
        action="store_true",
        default=d.use_dynamic_batch_size,
        help="Micro-batches of at most --max-tokens-per-gpu tokens (longest samples first, "
        "balanced; every DP rank runs the same number of micro-batches).",
    )
    g.add_argument(
        "--max-tokens-per-gpu",
        type=int,
        default=d.max_tokens_per_gpu,
        help="Token budget of one micro-batch per rank (with --use-dynamic-batch-size); a "
        "longer sample gets a micro-batch of its own.",
    )
    g.add_argument(
        "--qkv-format",
        choices=["thd", "bshd"],
        default=d.qkv_format,
        help="thd: pack each micro-batch's samples into one row (cu_seqlens; no attention "
        "across samples, positions restart per sample); bshd: pad to [b, s] (for debugging).",
    )


def _add_optimizer_args(g: argparse._ArgumentGroup, d: TrainerConfig) -> None:
    g.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"Peak learning rate (default: {d.lr:g} for the embedded default run, "
        f"{REAL_MODEL_LR:g} with --hf-checkpoint/--prompt-data/--prompt-source).",
    )
    g.add_argument("--min-lr", type=float, default=d.min_lr, help="Final learning rate.")
    g.add_argument(
        "--lr-warmup-init",
        type=float,
        default=d.lr_warmup_init,
        help="LR at the start of the warmup (megatron's schedule).",
    )
    g.add_argument(
        "--lr-warmup-iters",
        dest="lr_warmup_steps",
        type=int,
        default=d.lr_warmup_steps,
        help="Linear LR warmup steps.",
    )
    g.add_argument(
        "--lr-decay-iters",
        dest="lr_decay_steps",
        type=int,
        default=d.lr_decay_steps,
        help="LR decay steps (needed for linear/cosine).",
    )
    g.add_argument(
        "--lr-decay-style",
        default=d.lr_decay_style,
        choices=["constant", "linear", "cosine"],
        help="LR decay shape.",
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        default=d.weight_decay,
        help="Decoupled weight decay (not on norms/biases).",
    )
    g.add_argument("--adam-beta1", type=float, default=d.adam_beta1, help="AdamW beta1.")
    g.add_argument("--adam-beta2", type=float, default=d.adam_beta2, help="AdamW beta2.")
    g.add_argument("--adam-eps", type=float, default=d.adam_eps, help="AdamW epsilon.")
    g.add_argument(
        "--clip-grad", type=float, default=d.clip_grad, help="Gradient-norm clip (0 disables)."
    )
    g.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="Seed of model init, data order, sampling and the engines.",
    )


def _add_off_policy_args(g: argparse._ArgumentGroup, d: TrainerConfig) -> None:
    g.add_argument(
        "--routing-replay",
        default=None,
        choices=[m.value for m in RoutingReplay],
        help="MoE routing replay: none, r2 (trainer records), r3 (engine routing) "
        f"(default: {EMBEDDED_RUN.routing_replay.value} for the embedded default run, "
        f"{d.routing_replay.value} otherwise).",
    )
    g.add_argument(
        "--use-rollout-routing-replay",
        action="store_true",
        help="slime alias for --routing-replay r3.",
    )
    g.add_argument(
        "--keep-old-actor",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Keep version-j weight snapshots to compute pi_j^Meg (CompIS r2/r3 "
        "split; off: the combined ratio) (default: "
        f"{_on(EMBEDDED_RUN.keep_old_actor)} for the embedded default run, "
        f"{_on(d.keep_old_actor)} otherwise).",
    )
    g.add_argument(
        "--behavior-forward",
        default=None,
        choices=["trainer", "role"],
        help="Where pi_j^Meg is computed with --keep-old-actor: 'trainer' (snapshot forwards "
        "in the train step) or 'role' (a forward-only role, on the rollout cores, when each "
        "sample completes: off the trainer's critical path; see docs/compis.md) (default: "
        "role for an async run whose loss reads pi_j^Meg, trainer otherwise).",
    )
    g.add_argument(
        "--max-snapshots",
        type=int,
        default=None,
        help="Most version snapshots kept in CPU memory (default: the worst-case "
        "staleness + 1, which every kept version needs).",
    )


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _add_checkpoint_args(g: argparse._ArgumentGroup, d: TrainerConfig) -> None:
    g.add_argument("--load", default=d.load, help="Resume from this checkpoint directory.")
    g.add_argument("--save", default=d.save, help="Save checkpoints into this directory.")
    g.add_argument(
        "--hf-checkpoint",
        default=d.hf_checkpoint,
        help="HF weights directory to start from (not used when --load is given).",
    )
    g.add_argument(
        "--ref-load",
        default=d.ref_load,
        help="HF weights of the KL reference policy, with --use-kl-loss (default: the run's "
        "initial weights; required with --load).",
    )
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        default=d.keep_checkpoints,
        help="Complete checkpoints kept in --save.",
    )


def trainer_config_from_args(args: argparse.Namespace) -> TrainerConfig:
    """Build the config from parsed flags; a flag left None takes the `TrainerConfig` default.

    `--use-rollout-routing-replay` is slime's name for `--routing-replay r3`; giving it with a
    different `--routing-replay` is refused rather than letting one silently win.
    """
    names = {f.name for f in dataclasses.fields(TrainerConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names and k != "loss" and v is not None}
    if getattr(args, "use_rollout_routing_replay", False):
        if kw.get("routing_replay", "r3") != "r3":
            raise ValueError(
                f"--use-rollout-routing-replay means --routing-replay r3, but --routing-replay "
                f"{kw['routing_replay']} was also given; keep one of the two flags"
            )
        kw["routing_replay"] = RoutingReplay.R3
    cfg = TrainerConfig(**kw)
    check_world(cfg)
    return cfg
