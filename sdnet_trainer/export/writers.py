"""The output formats: each one's file name, the optional packages it needs, and its writer.
ONNX and torch.export trace the model and check the exported program's outputs against PyTorch's."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

FORMATS = ("pt", "safetensors", "onnx", "torch_export", "hf", "peft")
# format=all: every format any model exports (hf is for Llama models only and peft for LoRA runs,
# so they are asked by name).
ALL_FORMATS = ("pt", "safetensors", "onnx", "torch_export")
FILES = {
    "pt": "model.pt",
    "safetensors": "model.safetensors",
    "onnx": "model.onnx",
    "torch_export": "model.pt2",
    "hf": "config.json",  # with the shards and their index (export/hf.py)
    "peft": "adapter_config.json",  # with adapter_model.safetensors (export/peft.py)
}
# The optional packages each format imports; together they are the project's `export` extra.
REQUIRES = {
    "safetensors": ("safetensors",),
    "onnx": ("onnx", "onnxscript", "onnxruntime"),
    "hf": ("safetensors",),
    "peft": ("safetensors", "peft", "transformers"),
}
EXTRA_HINT = "pip install 'sdnet_trainer[export]'"

# The exported graph may reorder float operations; beyond this it computes something else.
ATOL, RTOL = 1e-4, 1e-3
ONNX_SINGLE_FILE_BYTES = 1_800_000_000


class ExportError(RuntimeError):
    """The model could not be exported to a format, or the export computes other outputs."""


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


def write(
    fmt: str,
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    path: Path,
    *,
    opset: int | None,
) -> float | None:
    """Write ``model`` as ``fmt`` to ``path``; for a traced format (onnx, torch_export), the
    largest absolute difference of the exported program's outputs to PyTorch's on ``inputs``."""
    if fmt == "pt":
        write_pt(model, path)
    elif fmt == "safetensors":
        write_safetensors(model, path)
    elif fmt == "onnx":
        return write_onnx(model, inputs, path, opset=opset)
    else:
        return write_torch_export(model, inputs, path)
    return None


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
