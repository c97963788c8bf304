"""Hugging Face Llama checkpoints in and out: the config and name mapping (kept as data), and the
loading of a safetensors folder into a model that may be sharded.

A Hugging Face Llama folder holds ``config.json`` and its weights, ``model.safetensors`` or
shards named by ``model.safetensors.index.json``. This project's :class:`Llama` uses the same
rotary layout as ``transformers`` (``rotate_half``), so the query and key projections load as they
are stored, with no permutation; only the names differ (:data:`HF_NAMES`).

:func:`load_hf_weights` fills a model *after* it is sharded: for each of its tensors a rank reads
only the block it holds (a DTensor's local shard of FSDP and/or tensor parallelism, or the whole
tensor where it is not sharded, nothing for the units a pipeline split removed), through
safetensors' lazy slices of the memory-mapped file. No rank reads the whole model.

The folder is untrusted input, read as data with clear errors: ``config.json`` and the index are
JSON of bounded size with typed fields; weight files are plain names directly in the folder,
opened without following symbolic links and only if they are regular files; every tensor's name,
shape and dtype is checked against the model before any value is read, and a name the model has
no place for, or a tensor it needs that the files lack, is an error naming the file.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

HF_PREFIX = "hf:"
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_JSON_MAX_BYTES = 64 << 20

# This project's parameter names -> Hugging Face LlamaForCausalLM's ({i}: the layer).
HF_NAMES: tuple[tuple[str, str], ...] = (
    ("embed.tok.weight", "model.embed_tokens.weight"),
    ("blocks.{i}.norm1.weight", "model.layers.{i}.input_layernorm.weight"),
    ("blocks.{i}.attn.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("blocks.{i}.attn.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("blocks.{i}.attn.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("blocks.{i}.attn.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("blocks.{i}.norm2.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("blocks.{i}.mlp.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("blocks.{i}.mlp.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("blocks.{i}.mlp.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("head.weight", "lm_head.weight"),
)
# Stored by some older exports, recomputed here: skipped when found.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# model.llama's keys <- config.json's (the rest of model.llama is built from several keys).
CONFIG_KEYS: tuple[tuple[str, str], ...] = (
    ("vocab_size", "vocab_size"),
    ("seq_len", "max_position_embeddings"),
    ("dim", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("hidden_dim", "intermediate_size"),
)
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


_TO_HF = [(_pattern(ours), hf) for ours, hf in HF_NAMES]
_FROM_HF = [(_pattern(hf), ours) for ours, hf in HF_NAMES]


def _translate(name: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, template in table:
        match = pattern.match(name)
        if match:
            return template.replace("{i}", match.group(1)) if match.groups() else template
    return None


def to_hf_name(name: str) -> str:
    hf = _translate(name, _TO_HF)
    if hf is None:
        raise KeyError(f"{name} has no Hugging Face Llama name")
    return hf


def from_hf_name(name: str) -> str | None:
    """This project's name for a Hugging Face Llama tensor name (None: not a Llama weight)."""
    return _translate(name, _FROM_HF)


# ---------------------------------------------------------------------- config.json


def hf_weights_folder(weights: str | None) -> Path | None:
    """The folder of ``model.weights=hf:PATH`` (None for any other value)."""
    if weights is None or not weights.startswith(HF_PREFIX):
        return None
    path = weights[len(HF_PREFIX) :]
    if not path:
        raise ConfigError("model.weights=hf: needs a folder: model.weights=hf:/path/to/model")
    return Path(path).expanduser()


def read_hf_config(path: str | Path, *, key: str) -> dict[str, Any]:
    """The JSON object of ``path`` (a config.json, or the folder holding one); ``key`` names the
    setting that gave the path, for the errors."""
    path = Path(path).expanduser()
    file = path / CONFIG_FILE if path.is_dir() else path
    config = _read_json(file, key=key)
    if not isinstance(config, dict):
        raise ConfigError(f"{key}: {file} is not a JSON object (a Hugging Face config.json)")
    return config


def llama_sizes_from_hf(config: dict[str, Any], *, source: str) -> dict[str, Any]:
    """``model.llama``'s keys from a Hugging Face config (a dict of config.json); a config this
    family cannot represent is a ConfigError naming ``source`` and the field."""

    def field(name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = config.get(name, default)
        if value is None or isinstance(value, bool) or not isinstance(value, kind):
            if value is None and default is None and name not in config:
                raise ConfigError(f"{source}: field {name!r} is missing")
            raise ConfigError(f"{source}: field {name!r} is {value!r}, expected {kind}")
        return value

    model_type = config.get("model_type")
    if model_type != "llama":
        raise ConfigError(
            f"{source}: field 'model_type' is {model_type!r}; model.name=llama reads Llama "
            f"checkpoints (model_type 'llama'); for other architectures use model=hf_causal_lm"
        )
    sizes = {ours: field(theirs, int) for ours, theirs in CONFIG_KEYS}
    heads = sizes["n_heads"]
    sizes["n_kv_heads"] = field("num_key_value_heads", int, heads)
    sizes["norm_eps"] = float(field("rms_norm_eps", (int, float), 1e-6))
    sizes["tie_embeddings"] = bool(config.get("tie_word_embeddings", False))
    expect = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    for name, wanted in expect.items():
        if config.get(name, wanted) != wanted:
            raise ConfigError(
                f"{source}: field {name!r} is {config[name]!r}; the Llama family here has "
                f"{name}={wanted!r}"
            )
    if config.get("attention_dropout", 0.0) not in (0, 0.0):
        raise ConfigError(
            f"{source}: field 'attention_dropout' is {config['attention_dropout']!r}; the Llama "
            f"family here has no dropout (0.0)"
        )
    head_dim = config.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim * heads != sizes["dim"]):
        raise ConfigError(
            f"{source}: field 'head_dim' is {head_dim!r}; the Llama family here has head_dim = "
            f"hidden_size / num_attention_heads = {sizes['dim']} / {heads}"
        )
    sizes["rope_theta"], sizes["rope_scaling"] = _rope(config, source)
    return sizes


def _rope(config: dict[str, Any], source: str) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) from transformers 5's ``rope_parameters`` or the older ``rope_theta`` and
    ``rope_scaling``."""
    params = config.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = config.get("rope_scaling") or {}
        field = "rope_scaling"
        params = {**params, "rope_theta": config.get("rope_theta", 10000.0)}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: field {field!r} is {params!r}, expected an object")
    theta = params.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: field 'rope_theta' is {theta!r}, expected a number > 0")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(
            f"{source}: field '{field}.rope_type' is {rope_type!r}; the Llama family here has "
            f"rotary scaling 'default' (none) or 'llama3'"
        )
    scaling: dict[str, Any] = {"rope_type": rope_type}
    if rope_type == "llama3":
        for name in _ROPE_KEYS:
            value = params.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(
                    f"{source}: field '{field}.{name}' is {value!r}, expected a number > 0"
                )
            scaling[name] = int(value) if name.startswith("original") else float(value)
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise ConfigError(
                f"{source}: field '{field}.high_freq_factor' must exceed low_freq_factor"
            )
    return float(theta), scaling


def hf_config_of(llama: nn.Module, *, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for ``model`` (a :class:`~sdnet_trainer.models.llama.Llama`), as
    ``transformers.LlamaConfig`` reads it (the ``rope_theta`` / ``rope_scaling`` spelling that
    transformers 4 and 5 both read)."""
    model: Any = llama  # its sizes are plain attributes
    sizes = {theirs: getattr(model, ours) for ours, theirs in CONFIG_KEYS}
    scaling = dict(model.rope_scaling)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **sizes,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.dim // model.n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": None if scaling.get("rope_type") == "default" else scaling,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# ---------------------------------------------------------------------- the weight files


def weight_files(folder: Path) -> dict[str, str]:
    """Hugging Face tensor name -> file name (plain, inside ``folder``), from the index or the
    single ``model.safetensors``, checked for containment; the files' contents are not read."""
    key = "model.weights"
    if not folder.is_dir():
        raise ConfigError(f"{key}=hf:{folder}: not a folder (config.json and safetensors files)")
    index = folder / INDEX_FILE
    if index.exists():
        data = _read_json(index, key=key)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{key}: {index}: field 'weight_map' is missing or empty")
        for name, file in weight_map.items():
            if (
                not isinstance(file, str)
                or not _plain_name(file)
                or not file.endswith(".safetensors")
            ):
                raise ConfigError(
                    f"{key}: {index}: field 'weight_map.{name}' is {file!r}, not a .safetensors "
                    f"file name inside {folder}"
                )
        return dict(weight_map)
    if not (folder / SINGLE_FILE).exists():
        raise ConfigError(
            f"{key}=hf:{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} is in the folder"
        )
    with _open_safetensors(folder, SINGLE_FILE) as f:
        return {name: SINGLE_FILE for name in f.keys()}  # noqa: SIM118 (not iterable)


def load_hf_weights(model: nn.Module, folder: Path) -> None:
    """Fill every parameter of ``model`` (a Llama, possibly sharded or pruned to pipeline stages)
    this rank holds from the Hugging Face folder, each from the slice of its file it holds."""
    files = weight_files(folder)
    state = model.state_dict(keep_vars=True)
    wanted: dict[str, list[str]] = {}  # hf name -> our names (a tied weight has two)
    for name in state:
        wanted.setdefault(to_hf_name(name), []).append(name)
    _check_names(model, files, wanted, folder)
    by_file: dict[str, list[str]] = {}
    for hf_name in wanted:
        if hf_name in files:
            by_file.setdefault(files[hf_name], []).append(hf_name)
    loaded: set[int] = set()
    read_bytes = 0
    for file, names in sorted(by_file.items()):
        with _open_safetensors(folder, file) as f:
            present = set(f.keys())  # noqa: SIM118 (not iterable)
            for hf_name in names:
                if hf_name not in present:
                    raise ConfigError(
                        f"model.weights: {folder / INDEX_FILE} puts {hf_name} in {file}, which "
                        f"does not hold it"
                    )
                lazy = f.get_slice(hf_name)
                for ours in wanted[hf_name]:
                    target = state[ours]
                    if id(target) in loaded:
                        continue  # a tied weight, already read under its other name
                    _check_tensor(lazy, target, hf_name=hf_name, ours=ours, where=folder / file)
                    read_bytes += _copy_local(lazy, target)
                    loaded.add(id(target))
    logger.info(
        "loaded %d tensors from %s (%.1f MB read by this rank)",
        len(loaded),
        folder,
        read_bytes / 2**20,
    )


def _check_names(
    model: nn.Module, files: dict[str, str], wanted: dict[str, list[str]], folder: Path
) -> None:
    tied = bool(getattr(model, "tie_embeddings", False))
    missing = [
        name
        for name in wanted
        if name not in files and not (tied and name == to_hf_name("head.weight"))
    ]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConfigError(
            f"model.weights=hf:{folder} lacks tensors the model needs: "
            f"{', '.join(missing[:5])}{more} (is config.json the checkpoint's own?)"
        )
    # Names of the whole model (a pipeline stage holds fewer), to tell foreign tensors apart.
    n_layers = getattr(model, "n_layers", 0)
    known = {hf.replace("{i}", str(i)) for _, hf in HF_NAMES for i in range(max(n_layers, 1))}
    extra = sorted(n for n in files if n not in known and not _IGNORED.fullmatch(n))
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ConfigError(
            f"model.weights=hf:{folder} holds tensors the Llama of its config.json has no place "
            f"for: {', '.join(extra[:5])}{more}"
        )


def _check_tensor(lazy: Any, target: torch.Tensor, *, hf_name: str, ours: str, where: Path) -> None:
    shape = tuple(lazy.get_shape())
    if shape != tuple(target.shape):
        raise ConfigError(
            f"model.weights: {where}: tensor {hf_name} has shape {list(shape)}, the model's "
            f"{ours} {list(target.shape)} (config.json and the weights disagree)"
        )
    dtype = lazy.get_dtype()
    if dtype not in ("F32", "F16", "BF16", "F64"):
        raise ConfigError(
            f"model.weights: {where}: tensor {hf_name} has dtype {dtype}; floating-point "
            f"weights expected (quantized checkpoints are not read)"
        )


@torch.no_grad()
def _copy_local(lazy: Any, target: torch.Tensor) -> int:
    """Copy the block of the stored tensor that ``target`` holds on this rank; bytes read."""
    if target.is_meta:
        return 0
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements
        )
        local = target.to_local()
    else:
        shape, offset = tuple(target.shape), (0,) * target.dim()
        local = target
    if 0 in shape:
        return 0
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} is not the block {shape}")
    block = lazy[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    local.copy_(block)
    return block.numel() * block.element_size()


# ---------------------------------------------------------------------- untrusted files


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and os.sep not in name


def _read_json(file: Path, *, key: str) -> Any:
    try:
        info = os.lstat(file)
    except FileNotFoundError:
        raise ConfigError(f"{key}: {file} does not exist") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{key}: {file} is not a regular file (a link or a folder)")
    if info.st_size > _JSON_MAX_BYTES:
        raise ConfigError(f"{key}: {file} is {info.st_size} bytes, more than a config holds")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: {file} is not valid JSON: {err}") from None


@contextmanager
def _open_safetensors(folder: Path, name: str) -> Iterator[Any]:
    """safetensors' ``safe_open`` of ``folder/name``, a regular file there: opened first with
    O_NOFOLLOW (a symbolic link is refused) and read through that descriptor, so the file
    checked is the file read."""
    from safetensors import SafetensorError, safe_open

    path = folder / name
    if not _plain_name(name):
        raise ConfigError(f"model.weights: refusing {name!r}: not a file name inside {folder}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"model.weights: {path} does not exist (named by the index)") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(
                f"model.weights: {path} is a symbolic link; weight files must be regular files "
                f"inside the folder"
            ) from None
        raise ConfigError(f"model.weights: cannot open {path}: {err.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"model.weights: {path} is not a regular file")
        via = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)
        try:
            handle = safe_open(via, framework="pt")
        except (SafetensorError, OSError, ValueError) as err:
            raise ConfigError(f"model.weights: {path} is not a safetensors file: {err}") from None
        with handle as f:
            yield f
    finally:
        os.close(fd)


__all__ = [
    "CONFIG_KEYS",
    "HF_NAMES",
    "HF_PREFIX",
    "INDEX_FILE",
    "from_hf_name",
    "hf_config_of",
    "hf_weights_folder",
    "llama_sizes_from_hf",
    "load_hf_weights",
    "read_hf_config",
    "to_hf_name",
    "weight_files",
]
