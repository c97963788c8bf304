"""The served model: rebuilt from a checkpoint or an export folder the way export does, run by
PyTorch or onnxruntime.

- A checkpoint (a ``step_*`` folder or a run's checkpoint directory) is verified and read with
  the checkpoint module's restricted readers; its training config rebuilds the bare model
  (``Trainer.build_model``) and DCP loads the weights from whatever parallel layout wrote them
  (:func:`sdnet_trainer.export.load_model`). ``backend=onnx`` then exports that model to ONNX in
  a temporary folder, as ``format=onnx`` would.
- An export folder holds ``config.yaml`` and ``model.pt`` (``backend=torch``; or
  ``model.safetensors``) or ``model.onnx`` (``backend=onnx``). Its files are read as data: each
  must be a regular file in the folder (no links), ``config.yaml`` is parsed as plain YAML (no
  aliases, no interpolation) and ``model.pt`` is loaded with ``weights_only=True``.

As with export, no class or module named by the checkpoint is imported: the model is rebuilt by
``sdnet_trainer.Trainer`` unless ``trainer=`` names another class.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Union

import torch
import yaml
from torch import nn

from sdnet_trainer import export
from sdnet_trainer.checkpoint import MANIFEST, Checkpoint, find_checkpoint
from sdnet_trainer.config import Config
from sdnet_trainer.data import is_language_model_data
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.hf_causal_lm import HFCausalLM
from sdnet_trainer.models.lora import is_adapted, merge_adapters
from sdnet_trainer.models.registry import model_family
from sdnet_trainer.serve.args import ServeArgs
from sdnet_trainer.serve.decoding import CausalLMDecoder
from sdnet_trainer.serve.errors import first_line
from sdnet_trainer.serve.hf_folder import eos_ids, is_hf_folder, load_hf_folder
from sdnet_trainer.serve.images import ImageModel, class_names, eval_transform
from sdnet_trainer.serve.language import LanguageModel, chat_renderer, codec
from sdnet_trainer.training.trainer import Trainer

logger = logging.getLogger(__name__)

_CONFIG_MAX_BYTES = 16 << 20
_ESCAPED = re.compile(r"(\\*)\$\{")

Served = Union[ImageModel, LanguageModel]


class Runner(Protocol):
    """Runs the model: a batch of inputs in, its float32 outputs back on the CPU."""

    context: int | None  # the longest token sequence a language model takes, if it says

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Source:
    """What ``checkpoint=`` names, read and checked, before any weights are loaded."""

    cfg: Config
    trainer_class: type[Trainer]
    checkpoint: Checkpoint | None  # None: an export folder
    folder: Path | None  # the export folder
    kind: str  # image | language

    def describe(self) -> str:
        if self.checkpoint is not None:
            return f"step {self.checkpoint.step} of {self.checkpoint.path}"
        return f"the export folder {self.folder}"


def resolve(args: ServeArgs) -> Source:
    """The checkpoint or export folder of ``args.checkpoint``, its training config and the Trainer
    class that rebuilds its model; a ConfigError naming what is wrong."""
    path = Path(args.checkpoint).expanduser()
    if is_export_folder(path):
        if args.ema:
            raise ConfigError(
                f"ema=true: checkpoint={args.checkpoint!r} is an export folder, which holds the "
                f"weights export wrote; pass the checkpoint to serve its EMA weights"
            )
        folder = path.resolve()
        data = _folder_config(folder)
        # export.training_config reads the config out of a checkpoint's meta; the folder's config
        # goes through the same schema merge, as data.
        stub = Checkpoint(path=folder, step=-1, world_size=1, meta={"config": data})
        cfg = export.training_config(stub)
        cls = export.trainer_class(stub, cfg, args.trainer)
        checkpoint = None
    else:
        checkpoint = find_checkpoint(args.checkpoint, key="checkpoint")
        cfg = export.training_config(checkpoint)
        cls = export.trainer_class(checkpoint, cfg, args.trainer)
        folder = None
    family = model_family(cfg.model.name)
    language = is_language_model_data(cfg.data) or (family is not None and family.language)
    return Source(cfg, cls, checkpoint, folder, "language" if language else "image")


def is_export_folder(path: Path) -> bool:
    return (
        path.is_dir() and (path / export.CONFIG_FILE).is_file() and not (path / MANIFEST).exists()
    )


def load_served(args: ServeArgs) -> tuple[Served, str]:
    """The model ``args.checkpoint`` names, ready for requests, and its description: a
    ``transformers`` model folder (config.json), or a checkpoint or export folder of this
    project."""
    path = Path(args.checkpoint).expanduser()
    if is_hf_folder(path):
        folder = path.resolve()
        logger.info("loading the transformers model folder %s", folder)
        model = load_hf_folder(args, folder, serving_device(args.device))
        return model, f"the transformers model folder {folder}"
    source = resolve(args)
    logger.info("loading %s (backend=%s)", source.describe(), args.backend)
    return load(args, source), source.describe()


def load(args: ServeArgs, source: Source) -> Served:
    """The model of ``source`` on its device, ready for requests (checked on an example input)."""
    device = serving_device(args.device)
    trainer = source.trainer_class(source.cfg)
    example = export.example_inputs(trainer)[0][:1]
    if args.backend == "onnx":
        runner: Runner = OnnxRunner(_onnx_session(args, source, trainer, device))
    else:
        runner = TorchRunner(_torch_model(args, source, trainer), device)
    try:
        output = runner(example)
    except Exception as err:
        raise ConfigError(
            f"the model of {source.describe()} fails on an example input of shape "
            f"{list(example.shape)}: {type(err).__name__}: {first_line(err)}"
        ) from err
    data = source.cfg.data
    if source.kind == "language":
        if output.dim() != 3:
            raise ConfigError(
                f"the model of {source.describe()} returns shape {list(output.shape)} for token "
                f"ids of shape {list(example.shape)}; serving expects logits (batch, tokens, vocab)"
            )
        lm = _hf_causal_lm(runner)
        # A transformers model (model.name=hf_causal_lm) generates with its KV cache, and so does
        # a model whose family has a generation model (the Llama: transformers' of its weights).
        family = model_family(source.cfg.model.name)
        served = getattr(runner, "model", None)
        generation = family.generation_model if family is not None else None
        cached = lm if lm is not None else (generation(served) if generation and served else None)
        tokens = codec(data)
        stop_ids: list[int] = []
        if lm is not None:
            stop_ids = eos_ids(lm)
        elif cached is not None and tokens.tokenizer is not None:
            # A Llama's end of sequence is its tokenizer's EOS (what data=text and data=chat
            # end documents and assistant turns with).
            eos = tokens.tokenizer.eos_id
            stop_ids = [eos] if eos is not None else []
        return LanguageModel(
            runner,
            context=runner.context if runner.context is not None else data.seq_len,
            vocab_size=int(output.shape[-1]),
            codec=tokens,
            max_new_tokens=args.max_new_tokens,
            decoder=CausalLMDecoder(cached, device) if cached is not None else None,
            stop_ids=stop_ids,
            chat=chat_renderer(tokens.tokenizer, data.chat_template),
        )
    if output.dim() != 2:
        raise ConfigError(
            f"the model of {source.describe()} returns shape {list(output.shape)} for an input "
            f"of shape {list(example.shape)}; serving expects class logits (batch, classes)"
        )
    count = int(output.shape[1])
    return ImageModel(
        runner,
        input_shape=tuple(example.shape[1:]),
        classes=class_names(data, count),
        transform=eval_transform(data),
        max_pixels=args.max_image_pixels,
        top_k=args.top_k,
    )


def _hf_causal_lm(runner: Runner) -> nn.Module | None:
    """The transformers model inside a TorchRunner's HFCausalLM, else None."""
    model = getattr(runner, "model", None)
    return model.lm if isinstance(model, HFCausalLM) else None


def serving_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name}: CUDA is not available here; pass device=cpu or auto")
    return device


# ---------------------------------------------------------------------- PyTorch


class TorchRunner:
    """The model in eval mode on ``device``: inputs in, float32 CPU outputs back."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model.to(device).eval()
        self.device = device
        self.context: int | None = getattr(model, "seq_len", None)  # a GPT's positions

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            output = self.model(inputs.to(self.device))
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"the model returns a {type(output).__name__}, not a tensor")
        return output.float().cpu()


def _torch_model(args: ServeArgs, source: Source, trainer: Trainer) -> nn.Module:
    if source.checkpoint is not None:
        return _checkpoint_model(args, source, trainer)
    assert source.folder is not None
    model = _build(source, trainer)
    state = _folder_weights(source.folder)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ConfigError(
            f"checkpoint={str(source.folder)!r}: the weights do not fit the model "
            f"{source.trainer_class.__name__}.build_model builds: {first_line(err)}"
        ) from None
    return _merged(model, source).eval()


def _checkpoint_model(args: ServeArgs, source: Source, trainer: Trainer) -> nn.Module:
    """export.load_model, which reads the checkpoint's weights through DCP in any layout."""
    assert source.checkpoint is not None
    options: dict[str, Any] = {}
    if "ema" in inspect.signature(export.load_model).parameters:
        options["ema"] = args.ema
    elif args.ema:
        raise ConfigError("ema=true: this version cannot load a checkpoint's EMA weights")
    try:
        model = export.load_model(trainer, source.checkpoint, **options)
    except ConfigError:
        raise
    except Exception as err:
        raise _rebuild_error(source, err) from err
    return _merged(model, source)


def _merged(model: nn.Module, source: Source) -> nn.Module:
    """A LoRA run's model with its adapters merged into the base (peft's merge, as ``export
    format=hf merge_lora=true``): the plain model serves with no adapter arithmetic per token,
    and its family's generation model takes its weights under their own names."""
    if not is_adapted(model):
        return model
    logger.info("merging the LoRA adapters of %s into the base model", source.describe())
    return merge_adapters(model)


def _build(source: Source, trainer: Trainer) -> nn.Module:
    try:
        return trainer.build_model()
    except ConfigError:
        raise
    except Exception as err:
        raise _rebuild_error(source, err) from err


def _rebuild_error(source: Source, err: Exception) -> ConfigError:
    """As export says it: the class to rebuild with, when the checkpoint records another one."""
    stub = source.checkpoint or Checkpoint(Path("."), step=-1, world_size=1, meta={})
    recorded = export.recorded_trainer(stub, source.cfg)
    hint = (
        f"; it was written by {recorded!r}: pass {export.trainer_hint(recorded)}"
        if recorded and source.trainer_class is Trainer
        else ""
    )
    return ConfigError(
        f"{source.trainer_class.__name__} cannot rebuild the model of {source.describe()} "
        f"({type(err).__name__}: {first_line(err)}){hint}"
    )


def _folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.pt (tensors only, ``weights_only``), else model.safetensors, of the export folder."""
    pt = folder / export.FILES["pt"]
    if os.path.lexists(pt):
        with _open_regular(pt) as file:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as err:  # pickle and zip errors of a bad file
                raise ConfigError(f"{pt} is not a readable state dict: {first_line(err)}") from None
        if not isinstance(state, dict):
            raise ConfigError(f"{pt} holds a {type(state).__name__}, not a state dict")
        return state
    st = folder / export.FILES["safetensors"]
    if os.path.lexists(st):
        export.require_modules(["safetensors"])
        from safetensors.torch import load as load_safetensors

        with _open_regular(st) as file:
            try:
                return load_safetensors(file.read())
            except Exception as err:
                raise ConfigError(f"{st} is not a readable safetensors file: {err}") from None
    raise ConfigError(
        f"checkpoint={str(folder)!r}: the export folder has no model.pt or model.safetensors for "
        f"backend=torch (export with format=pt)"
    )


# ---------------------------------------------------------------------- onnxruntime


class OnnxRunner:
    """An onnxruntime session: inputs in, float32 outputs back. Static dimensions of the exported
    graph are met by padding: the batch with copies of the last row (one run per full batch),
    the token dimension of a language model on the right (a causal model's outputs for the real
    positions do not depend on the positions after them)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        spec = session.get_inputs()[0]
        self.name = spec.name
        self.shape = [d if isinstance(d, int) else None for d in spec.shape]
        self.context = self.shape[1] if len(self.shape) == 2 else None

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        length = inputs.shape[1] if inputs.dim() == 2 else None
        if length is not None and self.context is not None and length < self.context:
            pad = inputs.new_zeros(inputs.shape[0], self.context - length)
            inputs = torch.cat([inputs, pad], dim=1)
        batch, rows = self.shape[0], inputs.shape[0]
        chunks = [inputs] if batch is None else list(inputs.split(batch))
        outputs = []
        for chunk in chunks:
            if batch is not None and len(chunk) < batch:
                filler = chunk[-1:].expand(batch - len(chunk), *chunk.shape[1:])
                chunk = torch.cat([chunk, filler])
            (out, *_) = self.session.run(None, {self.name: chunk.numpy()})
            outputs.append(torch.from_numpy(out))
        output = torch.cat(outputs)[:rows]
        return output[:, :length] if length is not None and output.dim() == 3 else output


def _onnx_session(args: ServeArgs, source: Source, trainer: Trainer, device: torch.device) -> Any:
    export.require_modules(["onnx"])
    import onnxruntime

    providers = ["CPUExecutionProvider"]
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            raise ConfigError(
                f"device={args.device} with backend=onnx needs onnxruntime with CUDA "
                f"(onnxruntime-gpu); pass device=cpu"
            )
        providers.insert(0, "CUDAExecutionProvider")
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # errors only
    if source.folder is not None:
        path = source.folder / export.FILES["onnx"]
        if not os.path.lexists(path):
            raise ConfigError(
                f"checkpoint={str(source.folder)!r}: the export folder has no model.onnx for "
                f"backend=onnx (export with format=onnx)"
            )
        if os.path.lexists(f"{path}.data"):
            raise ConfigError(
                f"{path} keeps its weights in an external data file; serving reads model.onnx "
                f"alone (models under 2 GB)"
            )
        with _open_regular(path) as file:
            model = file.read()
    else:
        with tempfile.TemporaryDirectory(prefix="sdnet_serve_") as tmp:
            path = Path(tmp) / export.FILES["onnx"]
            logger.info("exporting %s to ONNX for backend=onnx", source.describe())
            inputs = export.example_inputs(trainer)
            export.write_onnx(_checkpoint_model(args, source, trainer), inputs, path, opset=None)
            model = path.read_bytes()
    try:
        return onnxruntime.InferenceSession(model, options, providers=providers)
    except Exception as err:  # onnxruntime raises its own exception types
        raise ConfigError(f"{path} cannot be loaded by onnxruntime: {first_line(err)}") from None


# ---------------------------------------------------------------------- export folder files


def _open_regular(path: Path) -> Any:
    """``path`` opened for reading if it is a regular file, never through a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror} (links are not followed)") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")


def _folder_config(folder: Path) -> dict[str, Any]:
    """The export folder's config.yaml as plain data: YAML without aliases (a file of aliases can
    expand into more data than it holds), strings unescaped as export escaped them."""
    path = folder / export.CONFIG_FILE
    with _open_regular(path) as file:
        raw = file.read(_CONFIG_MAX_BYTES + 1)
    if len(raw) > _CONFIG_MAX_BYTES:
        raise ConfigError(f"{path} is larger than {_CONFIG_MAX_BYTES >> 20} MB")
    try:
        text = raw.decode("utf-8")
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, yaml.SafeLoader)):
            raise ConfigError(f"{path} uses YAML aliases, which export never writes")
        data = yaml.safe_load(text)
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"{path} is not readable YAML: {first_line(err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a config (a mapping of keys)")
    return _unescape(data)


def _unescape(value: Any) -> Any:
    """Undo ``export.escape_interpolations``: ``\\${`` back to ``${`` (with the backslashes before
    it halved). A ``${`` export did not escape stays the literal text it is."""
    if isinstance(value, str):
        if "${" not in value:
            return value

        def literal(m: re.Match[str]) -> str:
            run = len(m[1])
            return m[1][: (run - 1) // 2] + "${" if run % 2 else m[0]

        return _ESCAPED.sub(literal, value)
    if isinstance(value, dict):
        return {key: _unescape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_unescape(item) for item in value]
    return value
