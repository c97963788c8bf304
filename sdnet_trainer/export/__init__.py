r"""Export a checkpoint's model as files that other tools load without this package's training
code.

    python -m sdnet_trainer.export \
        checkpoint=outputs/quickstart/RUN/checkpoints/step_00000300 format=all

A checkpoint is a DCP folder of shards (one per rank that wrote it) holding model, optimizer and
loop state. What serving and inference tools want is the model alone, whole, in one file:

    model.pt            the full state dict; loads with ``torch.load(path, weights_only=True)``
    model.safetensors   the same tensors in the safetensors format
    model.onnx          the network as an ONNX graph, checked in onnxruntime against PyTorch
    model.pt2           a ``torch.export`` program (``torch.export.load(path).module()``)
    config.yaml         the training config, so the network can be rebuilt for the weights

and, for a GPT, a Llama or a mixture of experts (``model.name=gpt|llama|moe``), ``format=hf``: a
Hugging Face checkpoint folder
(``config.json``, ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``, the
run's tokenizer files) that ``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads as it
is (``export/hf.py``). A LoRA run's checkpoint (``model.lora``) holds its adapters alone; they
are rebuilt onto the run's frozen base and written as ``format=peft``: ``adapter_config.json`` and
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, out)`` loads on the
``transformers`` base model (``export/peft.py``); with ``merge_lora=true`` every format writes the
base with the adapters merged in (``format=hf merge_lora=true``: a Hugging Face folder of the
fine-tuned model).

The checkpoint carries the resolved training config, from which a Trainer rebuilds the bare model
(``Trainer.build_model``); the weights are loaded through DCP, which reassembles them from any
parallel layout and world size. Loading reads with the checkpoint module's restricted unpicklers.

A checkpoint is untrusted input: it may come from anywhere, and export reads it as data only.

- The Trainer class. The checkpoint records the class that wrote it (its manifest's
  ``meta.trainer``, and the config's ``trainer._target_``), but export never imports a class or
  module the checkpoint names: it rebuilds with this package's ``sdnet_trainer.Trainer``, or with
  the class named on the command line (``trainer=my_pkg.MyTrainer``). When the recorded class is
  another one, export says so and how to rebuild with it; when ``sdnet_trainer.Trainer`` cannot
  rebuild the checkpoint's model (a subclass with its own ``build_model``), the error names the
  ``trainer=`` to pass.
- The config. A stored config was written resolved, so it is read as plain data: nothing in it is
  interpolated or passed to a resolver. A string holding ``${`` stays that literal text; it is
  escaped (``\${``) wherever OmegaConf would interpret it, in ``config.yaml`` too, so loading the
  exported file gives back the literal text as well.
- The output folder (``out=``, default ``<checkpoint>/export``). Export creates it when absent and
  writes only inside it: it refuses (exit 2, naming the path) an output folder that is a symbolic
  link, and an existing file of the name of one it writes that is a link, not a regular file, or
  was not written by an earlier export. Each export records the files it wrote in
  ``export_manifest.json`` in the folder (merged with the earlier exports' entries); only files
  listed there are replaced, and a foreign ``export_manifest.json`` is refused as well. To export
  over other files, remove them or choose another ``out=``.

Arguments, as ``key=value``:

    checkpoint=PATH   a step_NNNNNNNN/ folder, or a checkpoint directory (its newest valid step)
    format=pt         pt | safetensors | onnx | torch_export | hf | peft | all, or several:
                      format=pt,onnx (all: every format but hf, which a decoder asks by name,
                      and peft, which a LoRA run's adapters ask by name; hf and safetensors
                      do not share a folder: transformers would read the wrong weights file)
    out=DIR           default: <checkpoint>/export
    opset=N           ONNX opset version (default: the exporter's)
    trainer=DOTTED    the Trainer class that rebuilds the model (default: sdnet_trainer.Trainer;
                      the checkpoint's recorded class is never imported unless named here)
    ema=true          the moving average of the weights (a run with model.ema) instead of them
    tokenizer=PATH    format=hf: the tokenizer files to put beside the model (a folder of them or
                      a tokenizer.json); default: the run's data.tokenizer when it is a local path
    merge_lora=true   a LoRA run's adapters merged into the base model (peft's merge) before any
                      format is written; format=hf of a LoRA run needs it

ONNX and torch.export trace the model on an example batch (see ``example_inputs``) with a dynamic
batch dimension where the model allows it, and check the exported program's outputs against
PyTorch's on that batch. onnx and safetensors need the ``export`` extra.

Exit codes: 0 done; 2 bad arguments, an unusable checkpoint or an output folder export will not
write into (the message names the key, path and values); 1 the model cannot be exported to a
requested format or its exported output differs from PyTorch's.

Files are written to a staging folder inside the output folder and moved into place by renames
only once every requested format is written and checked, so a failed export leaves no
half-written files behind.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import MISSING

from sdnet_trainer.checkpoint import Checkpoint, find_checkpoint
from sdnet_trainer.checkpoint.files import Folder
from sdnet_trainer.config.arguments import parse_key_values
from sdnet_trainer.config.paths import check_creatable_folder
from sdnet_trainer.errors import ConfigError

# The package's parts, one concern each; every name is also importable from here.
from sdnet_trainer.export.hf import hf_file_names, source_config, tokenizer_of, write_hf
from sdnet_trainer.export.output import (
    EXPORT_MANIFEST,
    check_output,
    output_folder,
    publish,
    staging_folder,
)
from sdnet_trainer.export.peft import PEFT_FILES, check_lora_args, merged_config, write_peft
from sdnet_trainer.export.rebuild import (
    DEFAULT_TRAINER,
    check_lora_base,
    config_yaml,
    escape_interpolations,
    example_inputs,
    load_model,
    recorded_trainer,
    trainer_class,
    trainer_hint,
    training_config,
)
from sdnet_trainer.export.remote import check_prefix, output_prefix, upload
from sdnet_trainer.export.writers import (
    ALL_FORMATS,
    EXTRA_HINT,
    FILES,
    FORMATS,
    ExportError,
    require_modules,
    write,
    write_onnx,
    write_safetensors,
)
from sdnet_trainer.models.lora import merge_adapters
from sdnet_trainer.models.registry import model_family

__all__ = [
    "CONFIG_FILE",
    "EXIT_BAD_INPUT",
    "EXIT_EXPORT_FAILED",
    "EXPORT_MANIFEST",
    "EXTRA_HINT",
    "FILES",
    "FORMATS",
    "ExportArgs",
    "ExportError",
    "Exported",
    "config_yaml",
    "escape_interpolations",
    "example_inputs",
    "export",
    "formats",
    "load_model",
    "parse_args",
    "recorded_trainer",
    "require_modules",
    "trainer_class",
    "trainer_hint",
    "training_config",
    "write_hf",
    "write_onnx",
    "write_peft",
    "write_safetensors",
]

logger = logging.getLogger(__name__)

EXIT_EXPORT_FAILED = 1
EXIT_BAD_INPUT = 2

CONFIG_FILE = "config.yaml"


@dataclass
class ExportArgs:
    # A checkpoint folder (step_NNNNNNNN/), or a checkpoint directory: its newest valid checkpoint.
    checkpoint: str = MISSING
    # pt | safetensors | onnx | torch_export | hf | peft | all, or several joined by commas.
    format: str = "pt"
    # Where the files go; null: <checkpoint>/export.
    out: Optional[str] = None
    # ONNX opset version; null: the exporter's default.
    opset: Optional[int] = None
    # The Trainer class (dotted path) whose build_model rebuilds the network; null:
    # sdnet_trainer.Trainer (the class recorded in the checkpoint is never imported implicitly).
    trainer: Optional[str] = None
    # Export the exponential moving average of the weights (a run with model.ema) instead of the
    # weights themselves.
    ema: bool = False
    # format=hf: the tokenizer files to copy beside the model; null: the run's data.tokenizer.
    tokenizer: Optional[str] = None
    # A LoRA run (model.lora): its adapters merged into the base model before writing any format.
    merge_lora: bool = False


@dataclass(frozen=True)
class Exported:
    """What one export wrote, and how close the exported programs are to PyTorch."""

    out: Folder  # a local folder, or an object store's prefix (export.remote)
    files: list[Folder]
    max_abs_diff: dict[str, float]  # per checked format (onnx, torch_export)


# ---------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str]) -> ExportArgs:
    """``key=value`` pairs onto ``ExportArgs``: an unknown key or a wrong type is a ConfigError."""
    args = parse_key_values(
        ExportArgs,
        argv,
        example="checkpoint=PATH format=onnx",
        missing="checkpoint=PATH is required (a step_* folder of a run's checkpoints)",
    )
    formats(args.format)  # fail on a bad format before any work
    return args


def formats(value: str) -> list[str]:
    """``format=`` as a list of format names, in the order of FORMATS."""
    names = {part.strip() for part in str(value).split(",") if part.strip()}
    if "all" in names:
        names = set(ALL_FORMATS) | (names - {"all"})
    unknown = sorted(names - set(FORMATS))
    if unknown or not names:
        raise ConfigError(
            f"format={value!r}: choose from {', '.join(FORMATS)}, all, or several joined "
            f"by commas" + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    if {"hf", "safetensors"} <= names:
        raise ConfigError(
            f"format={value!r}: hf and safetensors in one folder would give transformers two "
            f"weight files (it reads model.safetensors first); export them to separate out= "
            f"folders"
        )
    return [name for name in FORMATS if name in names]


# ---------------------------------------------------------------------- the command


def export(args: ExportArgs) -> Exported:
    names = formats(args.format)
    require_modules(names)
    checkpoint = find_checkpoint(args.checkpoint, key="checkpoint")
    written = [FILES[fmt] for fmt in names] + [CONFIG_FILE]
    written += hf_file_names() if "hf" in names else []
    written += list(PEFT_FILES) if "peft" in names else []
    prefix = output_prefix(args.out, checkpoint)
    if prefix is None:
        return _export(args, names, checkpoint, output_folder(args.out, checkpoint), written)
    # Into a store: written locally as any export, then uploaded (export.remote).
    check_prefix(prefix, written)  # before the slow work
    with tempfile.TemporaryDirectory(prefix="sdnet_export_") as local:
        done = _export(args, names, checkpoint, Path(local) / "export", written)
        assert isinstance(done.out, Path)
        files = upload(done.out, [f for f in done.files if isinstance(f, Path)], prefix)
    return Exported(out=prefix, files=list(files), max_abs_diff=done.max_abs_diff)


def _export(
    args: ExportArgs, names: list[str], checkpoint: Checkpoint, out: Path, written: list[str]
) -> Exported:
    """The export of ``checkpoint`` as ``names`` into the local folder ``out``."""
    cfg = training_config(checkpoint)
    lora, place = cfg.model.lora.enabled, str(checkpoint.path)
    check_lora_args(names, lora=lora, merge_lora=args.merge_lora, checkpoint=place)
    check_lora_base(checkpoint, cfg)  # its own message, not one about rebuilding with a class
    cls = trainer_class(checkpoint, cfg, args.trainer)
    # Refuse an output folder export will not write into before the slow work.
    check_output(out, written)
    check_creatable_folder("out", out)
    try:
        # A Trainer that is never set up (no process group, data or optimizer): build_model and
        # the example input read only its config.
        trainer = cls(cfg)
        model = load_model(trainer, checkpoint, ema=args.ema)
        if args.merge_lora:
            model = merge_adapters(model)  # the base's own modules, the adapters merged in
    except Exception as err:
        recorded = recorded_trainer(checkpoint, cfg)
        if args.trainer or recorded is None:
            raise
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(
            f"{DEFAULT_TRAINER} cannot rebuild the model of checkpoint="
            f"{str(checkpoint.path)!r} ({detail}); the checkpoint was written by {recorded!r}: "
            f"to rebuild its model with that class, pass {trainer_hint(recorded)}"
        ) from err
    inputs = example_inputs(trainer) if {"onnx", "torch_export"} & set(names) else ()
    logger.info(
        "exporting step %d of %s (written on %d rank(s), rebuilt with %s.%s) as %s to %s",
        checkpoint.step,
        checkpoint.path,
        checkpoint.world_size,
        cls.__module__,
        cls.__qualname__,
        ", ".join(names),
        out,
    )
    diffs: dict[str, float] = {}
    with staging_folder(out) as (folder, staging):
        for fmt in names:
            if fmt == "hf":
                tokenizer = args.tokenizer or tokenizer_of(cfg)
                family = model_family(cfg.model.name)
                write_hf(
                    model, staging, family=family, tokenizer=tokenizer, source=source_config(cfg)
                )
                continue
            if fmt == "peft":
                family = model_family(cfg.model.name)
                write_peft(model, staging, family=family, base=source_config(cfg))
                continue
            diff = write(fmt, model, inputs, staging / FILES[fmt], opset=args.opset)
            if diff is not None:
                diffs[fmt] = diff
        (staging / CONFIG_FILE).write_text(
            f"# The training config of {str(checkpoint.path)!r} (step {checkpoint.step}); "
            f"{cls.__module__}.{cls.__qualname__}.build_model builds the network for these "
            f"weights.\n" + config_yaml(merged_config(cfg) if args.merge_lora else cfg)
        )
        files = publish(folder, out, staging, checkpoint)
    return Exported(out=out, files=list(files), max_abs_diff=diffs)
