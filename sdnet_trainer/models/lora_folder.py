"""A peft adapter folder (``model.lora.adapter``: ``adapter_config.json`` and
``adapter_model.safetensors``), read as untrusted input as a Hugging Face folder is
(``models/hf_folder.py``): the config as a bounded JSON object with typed fields, the weights as a
regular safetensors file inside the folder, their header compared with the model's adapters
before any value is read. And the adapters' settings (``LoRASettings``): ``model.lora``'s, or
the folder's."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdnet_trainer.config.schema import ModelConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.hf_folder import FLOAT_DTYPES, listed, open_safetensors, read_hf_config
from sdnet_trainer.runtime.quiet import import_quietly

EXTRA_HINT = "pip install 'sdnet_trainer[lora]'"
ALL_LINEAR = "all-linear"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY = "model.lora.adapter"
# adapter_config.json fields of peft's LoRA variants this project does not train.
_UNSUPPORTED = {
    "bias": "none",
    "lora_bias": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}


def require_peft(key: str) -> Any:
    """The ``peft`` module, or a ConfigError naming ``key`` and the extra to install."""
    try:
        # peft imports torchao where installed: without torch's notices about its Enums.
        peft = import_quietly("peft")
    except ImportError as err:
        raise ConfigError(
            f"{key} needs the `peft` package (the lora extra), which is not installed: {EXTRA_HINT}"
        ) from err
    return peft


@dataclass(frozen=True)
class LoRASettings:
    """The adapters' shape: ``model.lora``'s, or those of ``model.lora.adapter``'s folder
    (``source`` names which, for the messages). ``targets``: Hugging Face's names, or
    ``all-linear``."""

    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...] | str
    use_dora: bool
    use_rslora: bool
    source: str

    def peft_config(self, target_modules: list[str] | str) -> Any:
        """peft's ``LoraConfig`` of these settings, for ``target_modules`` (peft's spelling)."""
        peft = require_peft("model.lora.enabled=true")
        return peft.LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=target_modules,
            use_dora=self.use_dora,
            use_rslora=self.use_rslora,
            bias="none",
            task_type="CAUSAL_LM",
        )


def lora_settings(cfg: ModelConfig) -> LoRASettings:
    """``model.lora``'s settings; with ``model.lora.adapter=PATH``, the shape (r, alpha,
    targets, DoRA) its ``adapter_config.json`` declares, checked as untrusted input."""
    lora = cfg.lora
    if lora.adapter is None:
        targets = list(lora.target_modules)
        return LoRASettings(
            r=lora.r,
            alpha=float(lora.alpha),
            dropout=lora.dropout,
            targets=ALL_LINEAR if targets == [ALL_LINEAR] else tuple(targets),
            use_dora=lora.use_dora,
            use_rslora=False,
            source="model.lora.target_modules",
        )
    folder = adapter_folder(lora.adapter)
    file = folder / ADAPTER_CONFIG
    config = read_hf_config(file, key=f"model.lora.adapter={lora.adapter}")
    where = f"model.lora.adapter: {file}"

    def field(name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        value = config.get(name, default)
        if value is ... or isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise ConfigError(f"{where}: field {name!r} is {config.get(name)!r}, expected {kind}")
        return value

    if config.get("peft_type") != "LORA":
        raise ConfigError(
            f"{where}: field 'peft_type' is {config.get('peft_type')!r}; model.lora.adapter "
            f"reads LoRA adapters ('LORA')"
        )
    for name, wanted in _UNSUPPORTED.items():
        if config.get(name, wanted) not in (wanted, None, {}, []):
            raise ConfigError(
                f"{where}: field {name!r} is {config[name]!r}; the adapters trained here have "
                f"{name}={wanted!r}"
            )
    targets = field("target_modules", (list, str))
    if isinstance(targets, list) and not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"{where}: field 'target_modules' is {targets!r}, expected names")
    r = field("r", int)
    if r < 1:
        raise ConfigError(f"{where}: field 'r' is {r}, expected >= 1")
    return LoRASettings(
        r=r,
        alpha=float(field("lora_alpha", (int, float))),
        dropout=lora.dropout,
        targets=targets if isinstance(targets, str) else tuple(sorted(targets)),
        use_dora=field("use_dora", bool, False),
        use_rslora=field("use_rslora", bool, False),
        source=f"{where}: field 'target_modules'",
    )


def adapter_folder(path: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"model.lora.adapter={path!r} is not a folder (a peft adapter: {ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS})"
        )
    return folder


def check_adapter_file(folder: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """The folder's adapter tensors (the safetensors header; no value read) against ``expected``
    (peft's name -> the model's shape): every one present with its shape and a floating-point
    dtype, none the model has no place for. A folder for another base fails here, naming the
    file and the tensor."""
    file = folder / ADAPTER_WEIGHTS
    if not file.exists() and (folder / "adapter_model.bin").exists():
        raise ConfigError(
            f"{KEY}: {folder} holds adapter_model.bin (a pickle, which is not read here); save "
            f"it as {ADAPTER_WEIGHTS} (peft's save_pretrained does by default)"
        )
    with open_safetensors(folder, ADAPTER_WEIGHTS, key=KEY) as f:
        stored = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (not iterable)
        shapes = {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in stored.items()}
    for name, wanted in expected.items():
        if name not in shapes:
            continue
        shape, dtype = shapes[name]
        if shape != tuple(wanted):
            raise ConfigError(
                f"{KEY}: {file}: tensor {name} has shape {list(shape)}, where the model's "
                f"adapter has {list(wanted)}: an adapter for another base model, or of another "
                f"rank (adapter_config.json's r)"
            )
        if dtype not in FLOAT_DTYPES:
            raise ConfigError(f"{KEY}: {file}: tensor {name} has dtype {dtype}")
    missing = sorted(name for name in expected if name not in shapes)
    extra = sorted(set(shapes) - set(expected))
    if missing or extra:
        problems = [f"lacks {listed(missing)}"] if missing else []
        problems += [f"holds {listed(extra)}, which the model has no place for"] if extra else []
        raise ConfigError(
            f"{KEY}: {file} {'; and '.join(problems)}: not an adapter of this model's layers "
            f"(another base model, or other target_modules)"
        )


def adapter_tensors(folder: Path, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors of ``names`` (checked by :func:`check_adapter_file` first)."""
    with open_safetensors(folder, ADAPTER_WEIGHTS, key=KEY) as f:
        for name in names:
            yield name, f.get_tensor(name)


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "ALL_LINEAR",
    "EXTRA_HINT",
    "LoRASettings",
    "adapter_folder",
    "adapter_tensors",
    "check_adapter_file",
    "lora_settings",
    "require_peft",
]
