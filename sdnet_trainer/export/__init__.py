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
    format=pt         pt | safetensors | onnx | torch_export | all, or several: format=pt,onnx
    out=DIR           default: <checkpoint>/export
    opset=N           ONNX opset version (default: the exporter's)
    trainer=DOTTED    the Trainer class that rebuilds the model (default: sdnet_trainer.Trainer;
                      the checkpoint's recorded class is never imported unless named here)
    ema=true          the moving average of the weights (a run with model.ema) instead of them

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

import importlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

import torch
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from sdnet_trainer.checkpoint import Checkpoint, CheckpointError, CheckpointManager, find_checkpoint
from sdnet_trainer.config import Config
from sdnet_trainer.config.arguments import parse_key_values
from sdnet_trainer.data import is_language_model_data
from sdnet_trainer.data.augment import crop_sizes
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.training.trainer import Trainer, resolve_trainer_class

logger = logging.getLogger("sdnet_trainer.export")  # also when run as __main__

EXIT_EXPORT_FAILED = 1
EXIT_BAD_INPUT = 2

FORMATS = ("pt", "safetensors", "onnx", "torch_export")
FILES = {
    "pt": "model.pt",
    "safetensors": "model.safetensors",
    "onnx": "model.onnx",
    "torch_export": "model.pt2",
}
CONFIG_FILE = "config.yaml"
# Lists the files exports wrote into their output folder: the only files a later export replaces.
EXPORT_MANIFEST = "export_manifest.json"
MANIFEST_WRITER = "sdnet_trainer.export"
_MANIFEST_MAX_BYTES = 1 << 20
_STAGING_PREFIX = ".staging_export_"
# The Trainer export rebuilds with unless trainer= names another, under the names it is recorded by.
DEFAULT_TRAINER = "sdnet_trainer.Trainer"
_DEFAULT_TRAINER_NAMES = frozenset(
    {DEFAULT_TRAINER, f"{Trainer.__module__}.{Trainer.__qualname__}"}
)
# The optional packages each format imports; together they are the project's `export` extra.
REQUIRES = {"safetensors": ("safetensors",), "onnx": ("onnx", "onnxscript", "onnxruntime")}
EXTRA_HINT = "pip install 'sdnet_trainer[export]'"

# Two, not one: torch.export specialises a dimension whose example size is 1, so an example batch
# of 1 could not be exported with a dynamic batch dimension.
EXAMPLE_BATCH = 2
# The exported graph may reorder float operations; beyond this it computes something else.
ATOL, RTOL = 1e-4, 1e-3
ONNX_SINGLE_FILE_BYTES = 1_800_000_000


class ExportError(RuntimeError):
    """The model could not be exported to a format, or the export computes other outputs."""


@dataclass
class ExportArgs:
    # A checkpoint folder (step_NNNNNNNN/), or a checkpoint directory: its newest valid checkpoint.
    checkpoint: str = MISSING
    # pt | safetensors | onnx | torch_export | all, or several joined by commas (pt,onnx).
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


@dataclass(frozen=True)
class Exported:
    """What one export wrote, and how close the exported programs are to PyTorch."""

    out: Path
    files: list[Path]
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
        names = set(FORMATS) | (names - {"all"})
    unknown = sorted(names - set(FORMATS))
    if unknown or not names:
        raise ConfigError(
            f"format={value!r}: choose from {', '.join(FORMATS)}, all, or several joined "
            f"by commas" + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    return [name for name in FORMATS if name in names]


def require_modules(names: Sequence[str]) -> None:
    """Import the optional packages the requested formats need, or say how to install them."""
    for fmt in names:
        for module in REQUIRES.get(fmt, ()):
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise ConfigError(
                    f"format={fmt} needs the Python module {module!r}, which cannot be "
                    f"imported ({err}): {EXTRA_HINT}"
                ) from None


# ---------------------------------------------------------------------- the checkpoint's model


def training_config(checkpoint: Checkpoint) -> Config:
    """The typed training config the checkpoint was written with, read as data: every string that
    holds ``${`` is escaped first (see ``escape_interpolations``), so no interpolation or resolver
    named by the checkpoint runs and such a string keeps its literal text."""
    saved = checkpoint.meta.get("config")
    if not isinstance(saved, dict):
        raise ConfigError(
            f"checkpoint={str(checkpoint.path)!r} holds no training config (its manifest's "
            f"meta has no 'config'): it predates exportable checkpoints"
        )
    try:
        # to_object of a structured Config is a Config instance.
        return cast(
            Config,
            OmegaConf.to_object(
                OmegaConf.merge(OmegaConf.structured(Config), escape_interpolations(saved))
            ),
        )
    except OmegaConfBaseException as err:
        raise ConfigError(
            f"checkpoint={str(checkpoint.path)!r}: its training config does not fit this "
            f"version's schema: {str(err).splitlines()[0]}"
        ) from None


# Any run of backslashes right before "${": OmegaConf reads "\${" as a literal "${" and "\\" before
# an interpolation as one backslash.
_INTERPOLATION = re.compile(r"(\\*)\$\{")


def escape_interpolations(value: Any) -> Any:
    """``value`` (JSON-like data: dicts, lists, scalars) with every string escaped so that OmegaConf
    gives back its literal text: ``${x}`` becomes ``\\${x}`` and the backslashes right before a
    ``${`` are doubled. Strings without ``${`` are never interpreted and stay as they are."""
    if isinstance(value, str):
        return _INTERPOLATION.sub(lambda m: m[1] * 2 + "\\${", value) if "${" in value else value
    if isinstance(value, dict):
        return {key: escape_interpolations(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [escape_interpolations(item) for item in value]
    return value


def config_yaml(cfg: Config) -> str:
    """``cfg`` as YAML that OmegaConf loads back to the same values, ``${`` included (escaped)."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=False, enum_to_str=True)
    return OmegaConf.to_yaml(escape_interpolations(data))


def recorded_trainer(checkpoint: Checkpoint, cfg: Config) -> str | None:
    """The Trainer class the checkpoint says wrote it, as text (never imported), when it is not
    this package's Trainer: its manifest's ``meta.trainer``, else the config's
    ``trainer._target_``. A class of a script run directly (``__main__.Name``) is named by the
    config's ``trainer._target_`` when that names a class of the same name."""
    meta = checkpoint.meta.get("trainer")
    target = cfg.trainer._target_ if isinstance(cfg.trainer._target_, str) else ""
    recorded = meta if isinstance(meta, str) and meta else target
    if not recorded or recorded in _DEFAULT_TRAINER_NAMES:
        return None
    name = recorded.rpartition(".")[2]
    if (
        recorded.startswith("__main__.")
        and not target.startswith("__main__.")
        and target.rpartition(".")[2] == name
    ):
        return target
    return recorded


def trainer_hint(recorded: str) -> str:
    """The ``trainer=`` argument that rebuilds with the ``recorded`` class."""
    if recorded.startswith("__main__."):
        name = recorded.rpartition(".")[2]
        return (
            f"trainer=my_package.my_module.{name} (the checkpoint records {recorded!r}, a class "
            f"of a script run directly: name it by an importable dotted path)"
        )
    return f"trainer={recorded}"


def trainer_class(checkpoint: Checkpoint, cfg: Config, override: str | None) -> type[Trainer]:
    """The class named by ``trainer=`` if given, else ``sdnet_trainer.Trainer``: the class the
    checkpoint records is information, never imported here. Logs the recorded class when it is
    another one."""
    recorded = recorded_trainer(checkpoint, cfg)
    if override:
        cls = resolve_trainer_class(override, key="trainer")
        if recorded is not None and recorded != override:
            logger.info(
                "rebuilding the model with trainer=%s; the checkpoint records the Trainer class %r",
                override,
                recorded,
            )
        return cls
    if recorded is not None:
        logger.warning(
            "the checkpoint records the Trainer class %r; export does not import classes a "
            "checkpoint names and rebuilds the model with %s; to rebuild it with the recorded "
            "class, pass %s",
            recorded,
            DEFAULT_TRAINER,
            trainer_hint(recorded),
        )
    return Trainer


def load_model(trainer: Trainer, checkpoint: Checkpoint, *, ema: bool = False) -> nn.Module:
    """The bare model of ``trainer`` with the checkpoint's weights (with ``ema``, their moving
    average: ``model.ema``), in eval mode on the CPU. Every model entry of the checkpoint must
    have its place in the model, and the other way round."""
    entry = "ema" if ema else "model"
    if ema and not checkpoint.has_key("ema"):
        raise ConfigError(
            f"ema=true: checkpoint={str(checkpoint.path)!r} holds no average of the weights "
            "(it was written without model.ema.enabled=true)"
        )
    model = trainer.build_model()
    state = model.state_dict()
    # A tied weight (an embedding shared with the output layer) is one tensor under two names;
    # the checkpoint may hold it under one of them only.
    request = {
        name: value
        for name, value in state.items()
        if name not in _aliases(state) or checkpoint.has_key(f"{entry}.{name}")
    }
    what = f"the model {type(trainer).__name__}.build_model builds"
    extra = _unmatched(checkpoint, state, entry)
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ConfigError(
            f"checkpoint={str(checkpoint.path)!r} holds weights {what} has no place for: "
            f"{', '.join(extra[:5])}{more}"
        )
    manager = CheckpointManager(
        checkpoint.path.parent, keep_last=1, async_save=False, rank=0, world_size=1
    )
    try:
        # DCP fills these tensors in place, resharding whatever layout the writer used.
        manager.load(checkpoint, {entry: request})
    except CheckpointError as err:
        raise ConfigError(
            f"checkpoint={str(checkpoint.path)!r} does not hold the weights of {what}: {err}"
        ) from None
    finally:
        manager.close()
    model.load_state_dict(state, strict=True)
    return model.eval()


def _unmatched(checkpoint: Checkpoint, state: dict[str, Any], entry: str) -> list[str]:
    """The checkpoint's ``entry`` (model or ema) keys that are no entry of ``state`` (nor inside
    one)."""
    prefix = entry + "."
    keys = sorted(k[len(prefix) :] for k in checkpoint._keys if k.startswith(prefix))
    unmatched = []
    for key in keys:
        parts = key.split(".")
        if not any(".".join(parts[:i]) in state for i in range(1, len(parts) + 1)):
            unmatched.append(key)
    return unmatched


def _aliases(state: dict[str, Any]) -> set[str]:
    """Names whose tensor shares its memory with a tensor listed earlier."""
    seen: set[tuple[int, int | torch.SymInt, tuple[int, ...]]] = set()
    aliases = set()
    for name, value in state.items():
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if key in seen:
            aliases.add(name)
        seen.add(key)
    return aliases


def example_inputs(trainer: Trainer) -> tuple[torch.Tensor, ...]:
    """Positional inputs for tracing the model, batch size EXAMPLE_BATCH.

    A Trainer subclass may define ``example_input()`` (a tensor or a tuple of them). A subclass
    with its own datasets gives its validation set's first samples, since its data config need not
    describe them. Otherwise the data config says: token ids ``(batch, data.seq_len)`` for
    language data, else images of ``data.channels`` at the size evaluation fed the model: the
    eval transform's crop for image files (``data.augment.val_crop_size``, by default
    ``data.image_size``), ``data.image_size`` for generated images."""
    custom = getattr(trainer, "example_input", None)
    if callable(custom):
        inputs = custom()
        return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if type(trainer).build_datasets is not Trainer.build_datasets:
        return _from_dataset(trainer)
    data = trainer.cfg.data
    g = torch.Generator().manual_seed(0)
    if is_language_model_data(data):
        return (torch.randint(0, data.vocab_size, (EXAMPLE_BATCH, data.seq_len), generator=g),)
    size = data.image_size if data.name == "synthetic" else crop_sizes(data).val_crop
    return (torch.randn(EXAMPLE_BATCH, data.channels, size, size, generator=g),)


def _from_dataset(trainer: Trainer) -> tuple[torch.Tensor, ...]:
    train, val = trainer.build_datasets()
    # Map-style datasets (build_datasets' contract) have a length; torch's Dataset type omits it.
    dataset = val if val is not None and len(val) else train  # type: ignore[arg-type]
    samples = [dataset[i % len(dataset)] for i in range(EXAMPLE_BATCH)]  # type: ignore[arg-type]
    first = samples[0]
    if isinstance(first, torch.Tensor):
        return (torch.stack(samples),)
    if isinstance(first, (tuple, list)) and isinstance(first[0], torch.Tensor):
        return (torch.stack([s[0] for s in samples]),)  # (inputs, targets, ...): the inputs
    raise ConfigError(
        f"{type(trainer).__name__}: cannot tell the model's input from a dataset sample of "
        f"type {type(first).__name__}; define {type(trainer).__name__}.example_input() "
        f"returning an example batch"
    )


# ---------------------------------------------------------------------- writers


def write_pt(model: nn.Module, path: Path) -> None:
    state = {name: value.detach().cpu() for name, value in model.state_dict().items()}
    torch.save(state, path)


def write_safetensors(model: nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    storages = set()
    for name, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            raise ExportError(
                f"format=safetensors: state dict entry {name!r} is a {type(value).__name__}, "
                f"not a tensor; safetensors stores tensors only"
            )
        value = value.detach().cpu().contiguous()
        # safetensors refuses tensors that share memory (a tied weight, views into one fused
        # buffer): each later one is written as a copy of its own.
        storage = value.untyped_storage().data_ptr()
        tensors[name] = value.clone() if storage in storages and value.numel() else value
        storages.add(storage)
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_onnx(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], path: Path, *, opset: int | None
) -> float:
    """Export with torch's ONNX exporter, then run the file in onnxruntime on ``inputs``; returns
    the largest absolute difference to the PyTorch outputs."""
    import onnxruntime

    def export(dynamic_shapes: Any) -> None:
        torch.onnx.export(
            model,
            inputs,
            str(path),
            opset_version=opset,  # None: the exporter's default
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            external_data=_needs_external_data(model),
            verbose=False,
        )

    _with_dynamic_batch(export, inputs, "onnx")
    if opset is not None and (written := _onnx_opset(path)) != opset:
        logger.warning(
            "format=onnx: opset=%d was asked for, the exporter wrote opset %s: it could not "
            "convert this model to opset %d",
            opset,
            written,
            opset,
        )
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # errors only: onnxruntime warns about unused initializers
    try:
        session = onnxruntime.InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"]
        )
        feeds = {arg.name: x.numpy() for arg, x in zip(session.get_inputs(), inputs)}
        got = [torch.from_numpy(v) for v in session.run(None, feeds)]
    except Exception as err:  # onnxruntime raises its own exception types
        raise ExportError(
            f"format=onnx: onnxruntime cannot run the exported model: {err}"
        ) from None
    return _compare("onnx", got, inputs, model)


def _onnx_opset(path: Path) -> int | None:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next(
        (entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")), None
    )


def _needs_external_data(model: nn.Module) -> bool:
    """One self-contained .onnx file unless the weights approach protobuf's 2 GB limit; then they
    go to a model.onnx.data file next to it."""
    size = sum(
        t.numel() * t.element_size()
        for t in model.state_dict().values()
        if isinstance(t, torch.Tensor)
    )
    return size > ONNX_SINGLE_FILE_BYTES


def write_torch_export(model: nn.Module, inputs: tuple[torch.Tensor, ...], path: Path) -> float:
    """``torch.export`` the model and save the program; loads it back and returns the largest
    absolute difference of its outputs to the model's."""

    def export(dynamic_shapes: Any) -> None:
        program = torch.export.export(model, inputs, dynamic_shapes=dynamic_shapes)
        torch.export.save(program, str(path))

    _with_dynamic_batch(export, inputs, "torch_export")
    with torch.no_grad():
        got = _leaves(torch.export.load(str(path)).module()(*inputs))
    return _compare("torch_export", got, inputs, model)


def _with_dynamic_batch(export: Any, inputs: tuple[torch.Tensor, ...], fmt: str) -> None:
    """Run ``export`` with dim 0 of every input marked as one dynamic batch dimension; a model
    that cannot be traced that way is exported for the example's batch size alone."""
    batch = torch.export.Dim("batch", min=1)
    try:
        with torch.no_grad():
            export(tuple({0: batch} for _ in inputs))
        return
    except Exception as err:
        # The exporters raise many types; the static retry says more if it fails.
        logger.warning(
            "format=%s: a dynamic batch dimension does not trace (%s); exporting for batch "
            "size %d only",
            fmt,
            str(err).splitlines()[0] if str(err) else type(err).__name__,
            inputs[0].shape[0],
        )
    try:
        with torch.no_grad():
            export(None)
    except Exception as err:
        raise ExportError(
            f"format={fmt}: the model cannot be exported: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}"
        ) from err


def _leaves(output: Any) -> list[torch.Tensor]:
    """The tensors of a model output (a tensor, or tuples / lists / dicts of them), in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for key in output for t in _leaves(output[key])]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _leaves(item)]
    return []


def _compare(
    fmt: str, got: list[torch.Tensor], inputs: tuple[torch.Tensor, ...], model: nn.Module
) -> float:
    with torch.no_grad():
        expected = _leaves(model(*inputs))
    if len(got) != len(expected):
        raise ExportError(
            f"format={fmt}: the exported model returns {len(got)} outputs, PyTorch {len(expected)}"
        )
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, expected)):
        if tuple(a.shape) != tuple(b.shape):
            raise ExportError(
                f"format={fmt}: output {i} has shape {tuple(a.shape)}, PyTorch's {tuple(b.shape)}"
            )
        diff = (a.double() - b.double()).abs()
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        if not bool((diff <= ATOL + RTOL * b.double().abs()).all()):
            raise ExportError(
                f"format={fmt}: output {i} differs from PyTorch by up to {float(diff.max()):.3g} "
                f"(tolerance {ATOL:g} + {RTOL:g} x |value|)"
            )
    return worst


# ---------------------------------------------------------------------- the command


def export(args: ExportArgs) -> Exported:
    names = formats(args.format)
    require_modules(names)
    checkpoint = find_checkpoint(args.checkpoint, key="checkpoint")
    cfg = training_config(checkpoint)
    cls = trainer_class(checkpoint, cfg, args.trainer)
    out = output_folder(args, checkpoint)
    # Refuse an output folder export will not write into before the slow work.
    _check_output(out, [FILES[fmt] for fmt in names] + [CONFIG_FILE])
    try:
        # A Trainer that is never set up (no process group, data or optimizer): build_model and
        # the example input read only its config.
        trainer = cls(cfg)
        model = load_model(trainer, checkpoint, ema=args.ema)
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
    with _staging(out) as (folder, staging):
        for fmt in names:
            path = staging / FILES[fmt]
            if fmt == "pt":
                write_pt(model, path)
            elif fmt == "safetensors":
                write_safetensors(model, path)
            elif fmt == "onnx":
                diffs[fmt] = write_onnx(model, inputs, path, opset=args.opset)
            else:
                diffs[fmt] = write_torch_export(model, inputs, path)
        (staging / CONFIG_FILE).write_text(
            f"# The training config of {str(checkpoint.path)!r} (step {checkpoint.step}); "
            f"{cls.__module__}.{cls.__qualname__}.build_model builds the network for these "
            f"weights.\n" + config_yaml(cfg)
        )
        files = _publish(folder, out, staging, checkpoint)
    return Exported(out=out, files=files, max_abs_diff=diffs)


# ---------------------------------------------------------------------- the output folder


def output_folder(args: ExportArgs, checkpoint: Checkpoint) -> Path:
    """``out=`` as an absolute path (its last part is not resolved: a link there is refused, not
    followed), else ``<checkpoint>/export``."""
    if args.out:
        return Path(os.path.abspath(Path(args.out).expanduser()))
    return checkpoint.path / "export"


def _check_output(out: Path, names: Iterable[str]) -> None:
    """Refuse an output folder that is a link or not a folder, or that holds a file of one of
    ``names`` that export may not replace. An absent folder is fine: the export creates it."""
    folder = _open_folder(out, create=False)
    if folder is None:
        return
    try:
        previous = _previous_exports(folder, out)
        for name in [*names, EXPORT_MANIFEST]:
            _check_target(folder, out, name, previous)
    finally:
        os.close(folder)


def _open_folder(out: Path, *, create: bool) -> int | None:
    """A descriptor of the folder ``out``, opened without following a link; None if it is absent
    and not ``create``d."""
    if out.is_symlink():
        raise _link_error(out)
    if create:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(out)  # never follows a link: an existing name, link or not, fails
        except FileExistsError:
            pass
        except OSError as err:
            raise ConfigError(f"out: cannot create the output folder {out}: {err}") from None
    try:
        return os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        if create:
            raise ConfigError(f"out: the output folder {out} vanished while exporting") from None
        return None
    except OSError as err:
        if out.is_symlink():
            raise _link_error(out) from None
        raise ConfigError(
            f"out: {out} is not a folder export can write into ({err.strerror}); pass "
            f"out=<a folder>"
        ) from None


def _link_error(out: Path) -> ConfigError:
    return ConfigError(
        f"out: the output folder {out} is a symbolic link (to {os.readlink(out)!r}); export "
        f"writes only into a real folder and never follows a link out of it: remove the link "
        f"or pass out=<a folder>"
    )


def _same_folder(folder: int, out: Path) -> None:
    """Refuse to go on when ``out`` no longer names the folder ``folder`` was opened on."""
    try:
        now = os.lstat(out)
    except OSError:
        now = None
    opened = os.fstat(folder)
    if (
        now is None
        or stat.S_ISLNK(now.st_mode)
        or (now.st_dev, now.st_ino)
        != (
            opened.st_dev,
            opened.st_ino,
        )
    ):
        raise ConfigError(f"out: the output folder {out} was replaced while exporting")


def _previous_exports(folder: int, out: Path) -> dict[str, Any]:
    """The files earlier exports wrote into ``out``, by name, from its EXPORT_MANIFEST; refuses a
    manifest that export did not write."""
    path = out / EXPORT_MANIFEST
    foreign = (
        f"{path} was not written by {MANIFEST_WRITER}: export does not replace it; move it "
        f"away or pass out=<another folder>"
    )
    try:
        info = os.lstat(EXPORT_MANIFEST, dir_fd=folder)
    except FileNotFoundError:
        return {}
    if not stat.S_ISREG(info.st_mode) or info.st_size > _MANIFEST_MAX_BYTES:
        raise ConfigError(foreign)
    try:
        fd = os.open(EXPORT_MANIFEST, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
        with os.fdopen(fd, "rb") as file:
            manifest = json.loads(file.read(_MANIFEST_MAX_BYTES + 1))
    except (OSError, ValueError):
        raise ConfigError(foreign) from None
    if not isinstance(manifest, dict) or manifest.get("written_by") != MANIFEST_WRITER:
        raise ConfigError(foreign)
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ConfigError(foreign)
    return {
        name: entry
        for name, entry in files.items()
        if isinstance(name, str) and _plain_name(name) and isinstance(entry, dict)
    }


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and os.sep not in name


def _check_target(folder: int, out: Path, name: str, previous: dict[str, Any]) -> None:
    """Refuse to put a file named ``name`` into ``out`` over a link, a folder, or a file that no
    earlier export wrote. EXPORT_MANIFEST itself was checked by ``_previous_exports``."""
    try:
        info = os.lstat(name, dir_fd=folder)
    except FileNotFoundError:
        return
    path = out / name
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(
            f"out: {path} is a symbolic link (to {os.readlink(name, dir_fd=folder)!r}); export "
            f"neither writes through nor replaces links: remove it or pass out=<another folder>"
        )
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(
            f"out: {path} exists and is not a regular file; export does not replace it: remove "
            f"it or pass out=<another folder>"
        )
    if name != EXPORT_MANIFEST and name not in previous:
        raise ConfigError(
            f"out: {path} exists and was not written by an earlier export (it is not listed in "
            f"{out / EXPORT_MANIFEST}); export does not overwrite it: move it away or pass "
            f"out=<another folder>"
        )


@contextmanager
def _staging(out: Path) -> Iterator[tuple[int, Path]]:
    """The output folder, created when absent (a descriptor of it), and a fresh staging folder
    inside it (same filesystem, so the final moves are renames), always removed."""
    folder = _open_folder(out, create=True)
    assert folder is not None  # created
    try:
        name = f"{_STAGING_PREFIX}{secrets.token_hex(8)}"
        try:
            os.mkdir(name, 0o700, dir_fd=folder)
        except OSError as err:
            raise ConfigError(f"out: cannot write into the output folder {out}: {err}") from None
        try:
            _same_folder(folder, out)
            yield folder, out / name
        finally:
            try:
                _same_folder(folder, out)
                shutil.rmtree(out / name, ignore_errors=True)
            except ConfigError:
                pass  # out names another folder now: leave its contents alone
    finally:
        os.close(folder)


def _publish(folder: int, out: Path, staging: Path, checkpoint: Checkpoint) -> list[Path]:
    """Move every staged file into ``out`` (the folder open as ``folder``), replacing only files
    an earlier export wrote, after every check passed; EXPORT_MANIFEST first, listing them (an
    ONNX model over 2 GB comes with its external data file, which moves along)."""
    _same_folder(folder, out)
    names = sorted(os.listdir(staging))
    previous = _previous_exports(folder, out)
    for name in names:
        if not stat.S_ISREG(os.lstat(staging / name).st_mode):
            raise ExportError(f"the exporters wrote {name!r}, which is not a regular file")
        _check_target(folder, out, name, previous)
    _check_target(folder, out, EXPORT_MANIFEST, previous)
    entries = dict(previous)
    for name in names:
        entries[name] = {"checkpoint": str(checkpoint.path), "step": checkpoint.step}
    manifest = {"written_by": MANIFEST_WRITER, "files": dict(sorted(entries.items()))}
    (staging / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    umask = os.umask(0)
    os.umask(umask)
    for name in [EXPORT_MANIFEST, *names]:
        # Some writers create private files; these are for sharing.
        os.chmod(staging / name, 0o666 & ~umask)
    # Renames within the opened folder: never through a link that took the place of ``out``.
    for name in [EXPORT_MANIFEST, *names]:
        os.replace(f"{staging.name}/{name}", name, src_dir_fd=folder, dst_dir_fd=folder)
    return [out / name for name in names]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sdnet_trainer.export key=value ...``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        return 0
    if not logging.getLogger().handlers:
        # This package's progress at INFO; the exporters' own INFO chatter (graph passes) stays out.
        logging.basicConfig(level=logging.WARNING, format="[%(name)s][%(levelname)s] %(message)s")
        logging.getLogger("sdnet_trainer").setLevel(logging.INFO)
    try:
        result = export(parse_args(argv))
    except ConfigError as err:
        print(f"export error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ExportError as err:
        print(f"export failed: {err}", file=sys.stderr)
        return EXIT_EXPORT_FAILED
    for path in result.files:
        print(f"wrote {path} ({path.stat().st_size / 2**20:.2f} MB)")
    for fmt, diff in result.max_abs_diff.items():
        print(f"{fmt}: outputs match PyTorch, max abs difference {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
