"""`--save` checkpoint -> Hugging Face directory: takes a trained model out after the run.

Owns `export_checkpoint` and its command line::

    python -m slime_async.tools.export_hf --load runs/x/checkpoints --out runs/x/hf-v40 \\
        [--hf-checkpoint SRC]

`--load` is a `--save` directory (its `latest` complete checkpoint) or one `iter_*` directory;
its `meta.json` holds the ModelSpec and, in the torch format, `model.pt` the full HF-named fp32
weights, so no trainer is built; a torch_dist checkpoint is restored by a one-rank trainer
(`convert_checkpoint.one_rank_trainer`: the whole model and its Adam state in memory). The output is what `--save-hf` writes (`slime_async.trainer.hf_save`): `--hf-checkpoint`
(the run's, or a .gguf file, converted into `<out>.gguf-src/`) gives it the source's config
fields, tokenizer and generation config. Refuses to replace a directory not written by
`--save-hf` or this tool. A LoRA checkpoint exports the merged model (`W + (alpha / r) · B A`)
and, with `--adapter-out DIR`, its PEFT adapter.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from clifields import flag


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ExportHfConfig:
    """What to export and where."""

    load: str | None = flag(None, metavar="CKPT")
    """Checkpoint to export (required): a --save directory (its latest complete checkpoint) or
    one iter_* directory in it."""
    out: str | None = flag(None, metavar="DIR")
    """HF directory to write (required): new, empty, or a previous --save-hf / export_hf
    output."""
    adapter_out: str | None = flag(None, metavar="DIR")
    """With a LoRA checkpoint (--lora-rank): also write its adapter here as a PEFT directory
    (loads with `peft` on top of the base); --out gets the merged model either way."""
    hf_checkpoint: str | None = flag(None, metavar="SRC")
    """The HF directory (or .gguf file) the run started from: the export carries its config
    fields, tokenizer and generation config (default: none, the config from the ModelSpec)."""


def export_checkpoint(
    load: str | Path,
    out: str | Path,
    *,
    source: str | None = None,
    adapter_out: str | Path | None = None,
) -> Path:
    """Write the latest complete checkpoint in `load` as an HF directory at `out` (a LoRA
    checkpoint: the adapter merged into the base, and the PEFT adapter at `adapter_out`)."""
    import torch

    from slime_async.contracts.model import ModelSpec
    from slime_async.contracts.weights import HFWeights
    from slime_async.tools.convert_gguf import converted_checkpoint
    from slime_async.trainer import checkpoint, hf_save

    errors = hf_save.target_errors(str(out), paths={"--load": str(load), "--hf-checkpoint": source})
    if errors:
        raise ValueError("; ".join(errors))
    if source is not None:
        converted = converted_checkpoint(source, Path(f"{out}.gguf-src"))
        source = str(converted or source)
    ckpt = checkpoint.find_latest(Path(load))
    meta = checkpoint.read_meta(ckpt)
    spec = ModelSpec.from_dict(meta["spec"])
    if checkpoint.ckpt_format(meta) == "torch_dist":  # shards: restored by a one-rank trainer
        from slime_async.tools.convert_checkpoint import one_rank_trainer

        tr = one_rank_trainer(ckpt, meta)
        tensors = tr.export_weights().tensors
        tr.shutdown()
    else:
        tensors = torch.load(ckpt / "model.pt", weights_only=True, map_location="cpu")
    if meta.get("lora") is not None:
        from slime_async.contracts.adapter import LoraSpec, write_peft_dir
        from slime_async.trainer import lora

        spec_lora = LoraSpec.from_peft_config(meta["lora"])
        adapter = torch.load(ckpt / "adapter.pt", weights_only=True, map_location="cpu")
        tensors = lora.merge(tensors, adapter, spec_lora)
        if adapter_out is not None:
            write_peft_dir(
                adapter_out, adapter, spec_lora, version=int(meta["version"]), base_model=source
            )
    elif adapter_out is not None:
        raise ValueError(f"--adapter-out: {ckpt} holds no LoRA adapter (a full fine-tune)")
    weights = HFWeights(version=int(meta["version"]), spec=spec, tensors=tensors)
    return hf_save.write(weights, out, source=source)


def main(argv: list[str] | None = None) -> int:
    from slime_async.tools import run_tool
    from slime_async.trainer.checkpoint import CheckpointError

    return run_tool(
        argv,
        prog="python -m slime_async.tools.export_hf",
        description="Convert a --save checkpoint into a Hugging Face directory "
        "(from_pretrained-loadable, as --save-hf writes it).",
        config=ExportHfConfig,
        action=lambda cfg: export_checkpoint(
            cfg.load, cfg.out, source=cfg.hf_checkpoint, adapter_out=cfg.adapter_out
        ),
        refusals=(CheckpointError, FileNotFoundError, FileExistsError, ValueError),
    )


if __name__ == "__main__":
    sys.exit(main())
