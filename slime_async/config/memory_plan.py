"""The memory plan: what each process of a one-node run holds at its peak, and the whole run's sum.

Owns `param_count` (a `ModelSpec`'s parameters), `activation_bytes` (what the trainer's layers
keep for the backward, per micro-batch, with and without recompute), `process_bytes` (per
process: the model state, the activations, the engines' KV cache and each process's measured
runtime), `fits` / `describe` (the sum against the run's memory limit) and
`largest_fitting_micro_batch` (the micro-batch token budget that fits). The `memory` rule
(`slime_async.config.rules.memory`) uses them to derive the micro-batch budget and
recompute of a CPU trainer, or `--behavior-forward trainer` when the forward-only role would not
fit, or to refuse, with the numbers, a run that cannot fit before anything starts (instead of
Ray's memory monitor killing a role mid-run). Pure functions; imports only the model contract.
Where each number comes from, and how well the sum predicts a measured run:
docs/cpu.md#memory.

**Model state**, per parameter (N parameters):

| process | bytes per parameter |
|---|---|
| trainer rank, fp32 | 4 weights + 4 gradient buffer + 8 Adam moments = 16, + 4 per snapshot |
| trainer rank, bf16 | 2 weights + 4 fp32 gradient buffer + 4 fp32 main weights + 8 Adam = 18, + 2 per snapshot |
| forward-only role | one copy per kept version (the parameters' dtype; the model's parameters are the newest one's) + the incoming version's file, mapped |
| embedded engine | its weights in the engine dtype (2 for bf16, 4 for fp32) + one version in flight in `--update-weight-dtype` during a weight sync |

The trainer's exports are views of its parameters: a push packs them bucket by bucket, an HF
directory is written tensor by tensor (a LoRA adapter folded in as each is written), and the
forward-only role's copy is one file the trainer writes tensor by tensor into this node's
memory file system (`/dev/shm`), which the role maps and removes.

With LoRA (A adapter numbers, fp32) the base is frozen and shared: the trainer holds the base
weights + 16 bytes per adapter number (weight, gradient buffer, two Adam moments) + 4 per
adapter number and snapshot; the forward-only role holds the base once + 4 · A per version,
for its model and for the adapter in flight.
Under tensor/pipeline parallelism each rank holds 1 / (TP × PP) of the weights; the
distributed optimizer shards the main weights and Adam moments over DP.

**Activations**: what the trainer's layer spec (megatron's local spec, unfused: the reference
math op for op) keeps per token for its backward, counted from the shapes (`layer_values`):
per layer 5·h (the two RMSNorms' input and output, the residual; the norms' own backward keeps
no normalised copy, `trainer/norm.py`) + 3·q + 2·kv (q/k/v and the output as the batched
attention pads them, `trainer/attention.py`, and the output projection's input; RoPE keeps only
its cos/sin tables)
+ 4·ffn (SwiGLU's gate, up, activation and product), + q + kv for q/k norms, for q =
heads·head_dim, kv = kv_heads·head_dim; an MoE layer keeps its routed copies instead of the
MLP. Counted for the CPU trainer (a GPU trainer's torch norms keep a normalised copy more). A value takes 4
bytes in fp32 and `BF16_BYTES_PER_VALUE` under bf16 (some tensors stay fp32). Full recompute
keeps each recomputed layer's input (h values) and one layer's activations at a time. On top,
at the backward's peak, the larger of one layer's backward (the gradients of its activations:
one layer's activations again) and the head's temporaries: a block of the head's weight
gradient (`HEAD_WEIGHT_GRAD_ROWS` × h in the compute dtype and in fp32; it is added into the
fp32 gradient buffer, the model state's), the head's fp32 logits and temporaries of one tile
(`HEAD_TEMPORARIES` × chunk × block, `head_tile`) and its chunk's hidden-state gradient being
summed (chunk × h, in fp32 and the compute dtype).

**Runtime**: each process's own bytes before it holds a model (Python, torch, megatron, Ray's
core worker): `RUNTIME`, measured on this project's processes (scripts/bench_memory.py).
"""

from __future__ import annotations

import dataclasses
import math

from slime_async.contracts.model import ModelSpec

MEMORY_FRACTION = 0.8
"""Share of the node's memory the run may take by default (Ray's memory monitor kills at 95%;
the plan predicts measured peaks within ±15%, docs/results/)."""
GIB = 1024**3
MIB = 1024**2

BF16_BYTES_PER_VALUE = 2.4
"""Bytes per saved activation value under bf16: the layers' tensors are bf16 (2), the norms'
statistics and a few upcasts fp32 (measured: 0.60× the fp32 bytes on SmolLM2's shapes)."""
HEAD_TEMPORARIES = 4
"""fp32 tiles (`head_tile`) alive at once in the head's backward (logits, softmax, its
gradient, one temporary; `trainer/lm_head.py`)."""
HEAD_WEIGHT_GRAD_ROWS = 4096
"""Vocabulary rows of the head's weight gradient alive at once (`trainer.lm_head.WGRAD_ROWS`):
a block's product in the compute dtype and its fp32 cast, added into the fp32 gradient buffer
block by block (before: a whole `[V, h]` product and the fp32 copy of it the add made; the
input embedding's dense gradient, too, goes into the buffer row by row: `trainer/embedding.py`)."""
ALLOCATOR_SLACK = 1.5
"""The process's peak over the tensors' own bytes during a forward+backward: glibc's heap keeps
blocks freed by earlier micro-batches that later ones cannot reuse (measured 1.48-1.63x on
SmolLM2's shapes, fp32 and bf16, 512- and 1024-token micro-batches; 1.0 with
MALLOC_MMAP_THRESHOLD_=65536, which made the step 1.75x slower)."""
CHUNK_ELEMENTS_CPU = 1 << 20
"""The head's logits per tile on a CPU (`trainer.lm_head.CHUNK_ELEMENTS`)."""
CHUNK_ELEMENTS_GPU = 1 << 26
"""The head's logits per chunk on a GPU (`trainer.lm_head.CHUNK_ELEMENTS_GPU`)."""
TILE_TOKENS_CPU = 2048
"""The head's most tokens per chunk on a CPU by default (`trainer.lm_head.TILE_TOKENS`)."""
BLOCK_ALIGN = 64
"""The head's vocabulary rows per block are a multiple of this (`trainer.lm_head.BLOCK_ALIGN`)."""


def head_tile(
    read: int, v: int, chunk_tokens: int | None = None, *, gpu: bool = False
) -> tuple[int, int]:
    """(tokens per chunk, vocabulary rows per block) of a trainer's head over `read` positions
    and `v` vocabulary rows: `trainer.lm_head.tiling`'s rule on a CPU, or on a GPU (`gpu`)."""
    elements = CHUNK_ELEMENTS_GPU if gpu else CHUNK_ELEMENTS_CPU
    if chunk_tokens:
        chunk = chunk_tokens
    elif gpu:  # whole-vocabulary chunks
        chunk = max(1, elements // max(1, v))
    else:
        chunk = max(1, math.ceil(read / max(1, math.ceil(read / TILE_TOKENS_CPU))))
    block = max(BLOCK_ALIGN, elements // chunk // BLOCK_ALIGN * BLOCK_ALIGN)
    return chunk, min(v, block)


def _head_bytes(
    read: int, v: int, h: int, chunk_tokens: int | None, w: int, *, gpu: bool = False
) -> int:
    """The head's temporaries at its backward's peak (`w`: bytes of the compute dtype): one
    tile's fp32 logits and temporaries, the chunk's summed hidden-state gradient (fp32, one
    block's part, the transposed hidden states) and a block of the weight gradient with its
    fp32 cast."""
    chunk, block = head_tile(read, v, chunk_tokens, gpu=gpu)
    chunk = min(read, chunk)
    return (
        HEAD_TEMPORARIES * chunk * block * 4
        + chunk * h * (4 + 2 * w)
        + min(block, HEAD_WEIGHT_GRAD_ROWS) * h * (w + 4)
    )


RUNTIME: dict[str, int] = {
    "ray": 350 * MIB,
    "driver": 300 * MIB,
    "router": 80 * MIB,
    "trainer": 330 * MIB,
    "role": 240 * MIB,
    "engine": 370 * MIB,
}
"""Each process's own bytes before it holds a model, as the node counts them (proportional set
size: the pages of torch's and Python's libraries that processes share counted once), measured
on the default run's processes at the whole run's peak, less what the plan counts for their
tiny model (scripts/bench_memory.py; the driver's is the SmolLM2 recipe's, which holds a
tokenizer; the trainer's and the role's re-measured after `cpu_compat` patch 12 left
TorchDynamo out of megatron's import, with the tiny MoE's one fused function run uncompiled:
compiling it on its first call, as the default run now does, adds 60-80 MiB to each of the two
there, docs/results/2026-11-28-small-machine.md):
`ray`: Ray's daemons together (GCS, raylet, dashboard and runtime-env agents, log monitor, an
idle worker); `driver`: train_async.py with the data worker; `router`; `trainer` and `role`: a
Ray actor with torch and megatron imported; `engine`: an embedded engine actor."""


FUSED_RUNTIME = 60 * MIB
"""What `--cpu-fused-kernels` adds to a CPU trainer rank: Inductor's modules beyond the
TorchDynamo that torch's optimizer imports anyway, and the compiled kernels (`trainer.fused`;
the trainer actor's highest PSS 59 MiB above the eager one's over the same ten steps of the
SmolLM2 recipe, docs/results/2026-11-29-fused-kernels.md)."""


def param_count(spec: ModelSpec) -> int:
    """Parameters of the model `spec` describes (embeddings, attention, MLP or experts, norms,
    a VL model's vision encoder)."""
    h, hd = spec.hidden_size, spec.head_dim
    attn = h * hd * (2 * spec.num_attention_heads + 2 * spec.num_key_value_heads)
    if spec.qkv_bias:
        attn += hd * (spec.num_attention_heads + 2 * spec.num_key_value_heads)
    if spec.qk_norm:
        attn += 2 * hd
    if spec.is_moe:
        mlp = spec.num_experts * 3 * h * spec.moe_intermediate_size + spec.num_experts * h
    else:
        mlp = 3 * h * spec.intermediate_size
    layer = attn + mlp + 2 * h
    embed = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    vision = spec.vision.param_count() if spec.vision is not None else 0
    return spec.num_layers * layer + embed + h + vision


def layer_values(spec: ModelSpec) -> int:
    """Values one layer keeps per token for its backward (module docstring: 'Activations')."""
    h = spec.hidden_size
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim
    attn = 5 * h + 3 * q + 2 * kv + (q + kv if spec.qk_norm else 0)
    if spec.is_moe:  # router scores + each routed copy's input, SwiGLU and output
        k, e = spec.moe_topk, spec.num_experts
        mlp = 3 * e + k * (2 * h + 4 * spec.moe_intermediate_size)
    else:
        mlp = 4 * spec.intermediate_size
    return attn + mlp


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Recompute:
    """Full activation recompute (megatron's `--recompute-granularity full`)."""

    method: str = "uniform"
    """uniform: groups of `num_layers` layers; block: the first `num_layers` layers."""
    num_layers: int = 1


def activation_bytes(
    spec: ModelSpec,
    tokens: int,
    *,
    bf16: bool,
    recompute: Recompute | None = None,
    layers: int | None = None,
    chunk_tokens: int | None = None,
    vocab_local: int | None = None,
    slack: float = 1.0,
    head_tokens: int | None = None,
    gpu: bool = False,
) -> int:
    """Peak bytes of one trainer rank's forward+backward over a micro-batch of `tokens` tokens,
    above its model state: the saved activations of its `layers` (default: all) + the head's
    head's temporaries (`_head_bytes`; `chunk_tokens`: `--logits-chunk-tokens`).
    `slack` multiplies the layers' part (`ALLOCATOR_SLACK` on a CPU), not the head's: its
    blocks are the same size chunk after chunk, so each reuses the last one's. `head_tokens`:
    the positions of a micro-batch whose log-probs are read, the only ones that go through the
    head (default: all `tokens`)."""
    n = spec.num_layers if layers is None else layers
    v = spec.vocab_size if vocab_local is None else vocab_local
    per_value = BF16_BYTES_PER_VALUE if bf16 else 4.0
    full = layer_values(spec) * per_value * slack  # bytes per token of one layer's activations
    read = tokens if head_tokens is None else min(tokens, head_tokens)
    head = _head_bytes(read, v, spec.hidden_size, chunk_tokens, 2 if bf16 else 4, gpu=gpu)
    if recompute is None:  # every layer's activations are alive when the head's backward runs
        kept, redo = n * full, 0.0
    elif recompute.method == "block":
        k = min(n, recompute.num_layers)
        kept, redo = k * spec.hidden_size * per_value * slack + (n - k) * full, full if k else 0.0
    else:
        g = max(1, recompute.num_layers)
        kept, redo = math.ceil(n / g) * spec.hidden_size * per_value * slack, g * full
    # what is kept, with the head's backward first, then one recomputed group at a time and
    # the gradients of one layer's activations as its backward makes them
    return int(tokens * kept) + max(head, int(tokens * (redo + full)))


def forward_bytes(
    spec: ModelSpec, tokens: int, *, bf16: bool, head_tokens: int | None = None
) -> int:
    """Peak bytes of a forward without a backward (the forward-only role) over `tokens` tokens:
    one layer's tensors at a time and the head's logits tile (of the `head_tokens` read
    positions, default all)."""
    per_value = BF16_BYTES_PER_VALUE if bf16 else 4.0
    read = tokens if head_tokens is None else min(tokens, head_tokens)
    chunk, block = head_tile(read, spec.vocab_size)
    return (
        int(tokens * layer_values(spec) * per_value)
        + HEAD_TEMPORARIES * min(read, chunk) * block * 4
    )


def kv_cache_bytes(spec: ModelSpec, tokens: int, *, dtype_bytes: int) -> int:
    """An engine's KV pool of `tokens` tokens (the embedded engine's `--prefix-cache-tokens`)."""
    per_token = spec.num_layers * 2 * spec.num_key_value_heads * spec.head_dim
    return tokens * per_token * dtype_bytes


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunShape:
    """What sets a one-node run's memory (from the flags)."""

    spec: ModelSpec
    trainer_ranks: int = 1
    tp_pp: int = 1
    """TP × PP: how many ways each rank's weights are split."""
    pp: int = 1
    dp: int = 1
    distributed_optimizer: bool = False
    bf16: bool = False
    trainer_on_gpu: bool = False
    """Trainer ranks on GPUs: their model state and activations are not in this node's RAM."""
    micro_batch_tokens: int = 0
    """Tokens of the largest micro-batch (0: no activations counted)."""
    head_tokens: int | None = None
    """Of those, the positions whose log-probs are read (the responses'), the only ones that go
    through the head; None: as many as `micro_batch_tokens`."""
    recompute: Recompute | None = None
    chunk_tokens: int | None = None
    trainer_snapshots: int = 0
    """Versions the trainer keeps (`--behavior-forward trainer` with `--keep-old-actor`)."""
    role_versions: int | None = None
    """Versions the forward-only role keeps (None: no role)."""
    engines: int = 0
    """Embedded engines on this node."""
    engine_bytes: int = 2
    """Bytes per parameter of an engine (2 for bf16, 4 for fp32)."""
    engine_cache_tokens: int = 0
    """Each engine's KV pool, in tokens."""
    wire_bytes: int = 4
    """Bytes per parameter of a version in flight (`--update-weight-dtype`): the trainer's
    export, the role's and each engine's incoming copy during a weight sync."""
    adapter_params: int = 0
    """LoRA: numbers in the adapter (`contracts.adapter.adapter_numel`); 0: full fine-tuning."""
    fused_kernels: bool = False
    """`--cpu-fused-kernels`: each CPU trainer rank holds Inductor and its kernels
    (`FUSED_RUNTIME`; the forward-only role runs the eager ones)."""

    @property
    def params(self) -> int:
        return param_count(self.spec)


def trainer_state_bytes(shape: RunShape) -> int:
    """One trainer rank's model state: weights, gradients, optimizer, snapshots."""
    w = 2 if shape.bf16 else 4
    per_rank = shape.params // max(1, shape.tp_pp)
    if shape.adapter_params:  # LoRA: the base frozen, gradients and Adam on the adapter only
        a = shape.adapter_params // max(1, shape.tp_pp)
        return per_rank * w + a * (16 + 4 * shape.trainer_snapshots)
    sharded = 8 + (4 if shape.bf16 else 0)  # Adam moments (+ fp32 main weights)
    opt = per_rank * sharded // (shape.dp if shape.distributed_optimizer else 1)
    return per_rank * (w + 4) + opt + per_rank * w * shape.trainer_snapshots


def trainer_activation_bytes(shape: RunShape) -> int:
    """One trainer rank's activations at the largest micro-batch (its share of the layers), with
    the CPU allocator's slack (`ALLOCATOR_SLACK`)."""
    if not shape.micro_batch_tokens:
        return 0
    return activation_bytes(
        shape.spec,
        shape.micro_batch_tokens,
        bf16=shape.bf16,
        recompute=shape.recompute,
        layers=math.ceil(shape.spec.num_layers / max(1, shape.pp)),
        chunk_tokens=shape.chunk_tokens,
        vocab_local=shape.spec.vocab_size * shape.pp // max(1, shape.tp_pp),
        slack=1.0 if shape.trainer_on_gpu else ALLOCATOR_SLACK,  # CUDA's allocator reuses
        head_tokens=shape.head_tokens,
        gpu=shape.trainer_on_gpu,
    )


def process_bytes(shape: RunShape) -> dict[str, int]:
    """Peak bytes per part of the run on this node: `trainer` (all ranks: state + activations +
    runtime, only the runtime when on GPUs; its exports are views of its parameters, written
    or sent tensor by tensor), `role` (the forward-only role: its versions, the model's
    parameters being the newest one's, + the incoming version's file, mapped), `engines`
    (weights + KV pool + runtime + an incoming version, each) and `runtime` (Ray's daemons,
    the driver, the router)."""
    w = 2 if shape.bf16 else 4
    flight = (shape.adapter_params or shape.params) * shape.wire_bytes  # a version in flight
    fused = FUSED_RUNTIME if shape.fused_kernels and not shape.trainer_on_gpu else 0
    rank = RUNTIME["trainer"]
    if not shape.trainer_on_gpu:
        rank += fused + trainer_state_bytes(shape) + trainer_activation_bytes(shape)
    out = {"trainer": rank * shape.trainer_ranks}  # a push and the role's file read views
    if shape.role_versions is not None:
        n, a, v = shape.params, shape.adapter_params, shape.role_versions
        if a:  # the shared base, the model's adapter and each version's; an adapter in flight
            weights = n * w + a * 4 * (1 + v) + a * 4
        else:  # the model's parameters are the newest version's; the incoming file, mapped
            weights = n * w * v + n * w
        fwd = forward_bytes(
            shape.spec, shape.micro_batch_tokens, bf16=shape.bf16, head_tokens=shape.head_tokens
        )
        out["role"] = RUNTIME["role"] + weights + (fwd if shape.micro_batch_tokens else 0)
    if shape.engines:
        kv = kv_cache_bytes(shape.spec, shape.engine_cache_tokens, dtype_bytes=shape.engine_bytes)
        each = RUNTIME["engine"] + shape.params * shape.engine_bytes + kv + flight
        out["engines"] = each * shape.engines
    out["runtime"] = RUNTIME["ray"] + RUNTIME["driver"] + RUNTIME["router"]
    return out


OBJECT_STORE_FLOOR = 256 * MIB
"""The smallest Ray object store a one-node run starts (batches, log-probs, LoRA adapters and
metrics take a few MiB a step)."""


def object_store_bytes(shape: RunShape) -> int:
    """Ray's object store for a one-node run, sized for what the run puts in it: batches and
    log-probs, each LoRA adapter version, and, with a forward-only role whose trainer cannot
    hand it a version in this node's memory file system, two versions in the parameters' dtype;
    never below `OBJECT_STORE_FLOOR`. Its pages are shared memory: only what objects touched
    is resident, and stays so (the store reuses it), so a store no larger than needed bounds
    what it can hold."""
    if shape.role_versions is None:
        return OBJECT_STORE_FLOOR
    w = 2 if shape.bf16 else 4
    version = shape.adapter_params * 4 if shape.adapter_params else shape.params * w
    return max(OBJECT_STORE_FLOOR, 2 * version)


def gpu_trainer_bytes(shape: RunShape) -> int:
    """One GPU trainer rank's bytes on its GPU (state + activations; the CUDA context aside)."""
    return trainer_state_bytes(shape) + trainer_activation_bytes(shape)


def largest_fitting_micro_batch(
    shape: RunShape, limit: int, candidates: tuple[int, ...]
) -> int | None:
    """The largest of `candidates` (micro-batch tokens) whose run fits in `limit` bytes."""
    for tokens in sorted(candidates, reverse=True):
        if (
            sum(process_bytes(dataclasses.replace(shape, micro_batch_tokens=tokens)).values())
            <= limit
        ):
            return tokens
    return None


def fits(parts: dict[str, int], limit: int) -> bool:
    return sum(parts.values()) <= limit


def describe(parts: dict[str, int], limit: int, memory_bytes: int | None = None) -> str:
    """'trainer 7.1 GiB + role 2.2 GiB + ... = 9.3 GiB of 8.0 GiB allowed (80% of 10.0 GiB)'."""
    terms = " + ".join(f"{k} {v / GIB:.1f} GiB" for k, v in parts.items())
    where = (
        f"{limit / memory_bytes:.0%} of the node's {memory_bytes / GIB:.1f} GiB"
        if memory_bytes
        else "--memory-limit-gib"
    )
    return (
        f"{terms} = {sum(parts.values()) / GIB:.1f} GiB of {limit / GIB:.1f} GiB allowed ({where})"
    )
