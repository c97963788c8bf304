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

The checkpoint carries the resolved training config and the name of the Trainer class that wrote
it, so the export rebuilds the very same bare model (``Trainer.build_model``, custom subclasses
included) and loads the weights through DCP, which reassembles them from any parallel layout and
world size. Loading reads with the checkpoint module's restricted unpicklers.

Arguments, as ``key=value``:

    checkpoint=PATH   a step_NNNNNNNN/ folder, or a checkpoint directory (its newest valid step)
    format=pt         pt | safetensors | onnx | torch_export | all, or several: format=pt,onnx
    out=DIR           default: <checkpoint>/export
    opset=N           ONNX opset version (default: the exporter's)
    trainer=DOTTED    the Trainer class that rebuilds the model (default: the one that wrote it)

ONNX and torch.export trace the model on an example batch (see ``example_inputs``) with a dynamic
batch dimension where the model allows it, and check the exported program's outputs against
PyTorch's on that batch. onnx and safetensors need the ``export`` extra.

Exit codes: 0 done; 2 bad arguments or an unusable checkpoint (the message names the key and the
values); 1 the model cannot be exported to a requested format or its exported output differs from
PyTorch's.

Files are written to a staging folder and moved into place only once every requested format is
written and checked, so a failed export leaves no half-written files behind.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional, cast

import torch
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from torch import nn

from sdnet_trainer.checkpoint import Checkpoint, CheckpointError, CheckpointManager, find_checkpoint
from sdnet_trainer.config import Config
from sdnet_trainer.data import LM_DATASETS
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.trainer import Trainer, resolve_trainer_class

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
    # The Trainer class (dotted path) whose build_model rebuilds the network; null: the class
    # recorded in the checkpoint.
    trainer: Optional[str] = None


@dataclass(frozen=True)
class Exported:
    """What one export wrote, and how close the exported programs are to PyTorch."""

    out: Path
    files: list[Path]
    max_abs_diff: dict[str, float]  # per checked format (onnx, torch_export)


# ---------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str]) -> ExportArgs:
    """``key=value`` pairs onto ``ExportArgs``: an unknown key or a wrong type is a ConfigError."""
    known = [f.name for f in fields(ExportArgs)]
    for arg in argv:
        key, eq, _ = arg.partition("=")
        if not eq:
            raise ConfigError(
                f"argument {arg!r} is not key=value (e.g. checkpoint=PATH format=onnx)"
            )
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"unknown key {key} in {arg!r}: the keys are {', '.join(known)}{hint}"
            )
    try:
        # to_object of a structured ExportArgs config is an ExportArgs instance.
        args = cast(
            ExportArgs,
            OmegaConf.to_object(
                OmegaConf.merge(
                    OmegaConf.structured(ExportArgs), OmegaConf.from_dotlist(list(argv))
                )
            ),
        )
    except MissingMandatoryValue:
        raise ConfigError(
            "checkpoint=PATH is required (a step_* folder of a run's checkpoints)"
        ) from None
    except OmegaConfBaseException as err:  # a value of the wrong type
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"{key}: {str(err).splitlines()[0]}") from None
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
    """The typed training config the checkpoint was written with."""
    saved = checkpoint.meta.get("config")
    if not isinstance(saved, dict):
        raise ConfigError(
            f"checkpoint={str(checkpoint.path)!r} holds no training config (its manifest's "
            f"meta has no 'config'): it predates exportable checkpoints"
        )
    try:
        # to_object of a structured Config is a Config instance.
        return cast(
            Config, OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), saved))
        )
    except OmegaConfBaseException as err:
        raise ConfigError(
            f"checkpoint={str(checkpoint.path)!r}: its training config does not fit this "
            f"version's schema: {str(err).splitlines()[0]}"
        ) from None


def trainer_class(checkpoint: Checkpoint, cfg: Config, override: str | None) -> type[Trainer]:
    """``trainer=`` if given, else the class recorded in the checkpoint (default: Trainer)."""
    target = override or checkpoint.meta.get("trainer") or "sdnet_trainer.Trainer"
    key = "trainer" if override else "the checkpoint's trainer"
    if target.startswith("__main__."):
        # Written by a script run directly (launch(MyTrainer)): its module has no importable name.
        # The config names the same class when the recipe sets trainer._target_.
        name = target.rpartition(".")[2]
        if cfg.trainer._target_.rpartition(".")[2] != name:
            raise ConfigError(
                f"the checkpoint was written by {target}, a class of a script run directly; "
                f"name it by an importable dotted path: trainer=my_package.my_module.{name}"
            )
        target, key = cfg.trainer._target_, "the config's trainer._target_"
    return resolve_trainer_class(target, key=key)


def load_model(trainer: Trainer, checkpoint: Checkpoint) -> nn.Module:
    """The bare model of ``trainer`` with the checkpoint's weights, in eval mode on the CPU."""
    model = trainer.build_model()
    state = model.state_dict()
    # A tied weight (an embedding shared with the output layer) is one tensor under two names;
    # the checkpoint may hold it under one of them only.
    request = {
        name: value
        for name, value in state.items()
        if name not in _aliases(state) or checkpoint.has_key(f"model.{name}")
    }
    manager = CheckpointManager(
        checkpoint.path.parent, keep_last=1, async_save=False, rank=0, world_size=1
    )
    try:
        # DCP fills these tensors in place, resharding whatever layout the writer used.
        manager.load(checkpoint, {"model": request})
    except CheckpointError as err:
        raise ConfigError(
            f"checkpoint={str(checkpoint.path)!r} does not hold the weights of the model "
            f"{type(trainer).__name__}.build_model builds: {err}"
        ) from None
    finally:
        manager.close()
    model.load_state_dict(state, strict=True)
    return model.eval()


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
    language data, images ``(batch, data.channels, data.image_size, data.image_size)`` else."""
    custom = getattr(trainer, "example_input", None)
    if callable(custom):
        inputs = custom()
        return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if type(trainer).build_datasets is not Trainer.build_datasets:
        return _from_dataset(trainer)
    data = trainer.cfg.data
    g = torch.Generator().manual_seed(0)
    if data.name in LM_DATASETS:
        return (torch.randint(0, data.vocab_size, (EXAMPLE_BATCH, data.seq_len), generator=g),)
    return (
        torch.randn(EXAMPLE_BATCH, data.channels, data.image_size, data.image_size, generator=g),
    )


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
    out = Path(args.out).expanduser().resolve() if args.out else checkpoint.path / "export"
    # A Trainer that is never set up (no process group, data or optimizer): build_model and the
    # example input read only its config.
    trainer = cls(cfg)
    model = load_model(trainer, checkpoint)
    inputs = example_inputs(trainer) if {"onnx", "torch_export"} & set(names) else ()
    logger.info(
        "exporting step %d of %s (written by %s on %d rank(s)) as %s to %s",
        checkpoint.step,
        checkpoint.path,
        cls.__name__,
        checkpoint.world_size,
        ", ".join(names),
        out,
    )
    diffs: dict[str, float] = {}
    with _staging(out) as staging:
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
            f"# The training config of {checkpoint.path} (step {checkpoint.step}); "
            f"{cls.__module__}.{cls.__qualname__}.build_model builds the network for these "
            f"weights.\n" + OmegaConf.to_yaml(OmegaConf.structured(cfg))
        )
        files = _publish(staging, out)
    return Exported(out=out, files=files, max_abs_diff=diffs)


@contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A fresh folder inside ``out`` (same filesystem, so the final moves are renames), always
    removed."""
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging_export_", dir=out))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, out: Path) -> list[Path]:
    """Move every staged file into ``out``, replacing an earlier export's file of the same name
    (an ONNX model over 2 GB comes with its external data file, which moves along)."""
    umask = os.umask(0)
    os.umask(umask)
    files = []
    for path in sorted(staging.iterdir()):
        target = out / path.name
        os.chmod(path, 0o666 & ~umask)  # some writers create private files; these are for sharing
        os.replace(path, target)
        files.append(target)
    return files


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
