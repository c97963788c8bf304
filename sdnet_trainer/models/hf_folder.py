"""A Hugging Face model folder, read as untrusted input: its ``config.json``, its weight files
(``model.safetensors``, or shards named by ``model.safetensors.index.json``) and what their
safetensors headers declare, compared with a model built on the meta device before anything is
allocated.

``config.json`` says how large a model to build, and the weights say what the folder really
holds. A folder whose config was edited, or that is not the checkpoint's own, would have every
rank allocate the model the config claims (gigabytes, or more than the machine has) before the
first tensor is read. So the families that read such folders compare the model they built on the
meta device with the headers first (:func:`stored_tensors`, :func:`check_stored`): the names,
shapes and dtypes, every file the index names, each file whole. The headers are a few kilobytes
read through safetensors itself; no tensor's values are read.

The files are opened as data: JSON of bounded size with typed fields; weight files are plain names
directly in the folder, opened without following symbolic links and only if they are regular
files (:func:`open_safetensors`).

Once checked, the values are read by torch's DCP through its ``HuggingFaceStorageReader``
(:func:`read_folder`) into a state dict that a family's state-dict adapter makes of the model
(Hugging Face's names, values over the model's own storage: DTensors, plain tensors, or views of
them), so each rank reads only the elements of its own shards. The reader's metadata is the
checked headers (the files the index names, not every ``*.safetensors`` the folder holds), and
it reads each file through the descriptor opened as above.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import stat
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan

from sdnet_trainer.config.schema import ModelConfig
from sdnet_trainer.errors import ConfigError

HF_PREFIX = "hf:"
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_JSON_MAX_BYTES = 64 << 20
# The dtypes a weight is read from (into the model's): floating point, not quantized.
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_LISTED = 5  # names quoted in one message; the rest are counted


def hf_weights_folder(weights: str | None) -> Path | None:
    """The folder of ``model.weights=hf:PATH`` (None for any other value)."""
    if weights is None or not weights.startswith(HF_PREFIX):
        return None
    path = weights[len(HF_PREFIX) :]
    if not path:
        raise ConfigError("model.weights=hf: needs a folder: model.weights=hf:/path/to/model")
    return Path(path).expanduser()


class HFConfigSource(NamedTuple):
    """Where a family reads its architecture from a Hugging Face config.json."""

    key: str  # the setting that names it: model.weights or model.hf_config
    given: str | Path  # the folder of model.weights=hf:PATH, or model.hf_config as written
    file: Path  # the config.json itself


def hf_config_source(cfg: ModelConfig) -> HFConfigSource | None:
    """The config.json of ``model.weights=hf:PATH`` or ``model.hf_config`` (a file, or the
    folder holding one); None with neither. Refused: another kind of ``model.weights`` (these
    families load Hugging Face folders only), and both keys at once."""
    folder = hf_weights_folder(cfg.weights)
    if cfg.weights is not None and folder is None:
        raise ConfigError(
            f"model.weights={cfg.weights!r}: model.name={cfg.name!r} loads Hugging Face "
            f"checkpoints only, as model.weights=hf:PATH (a local folder)"
        )
    if folder is not None and cfg.hf_config is not None:
        raise ConfigError(
            f"model.weights={cfg.weights!r} brings its own config.json; leave model.hf_config "
            f"(={cfg.hf_config!r}) unset"
        )
    if folder is not None:
        return HFConfigSource("model.weights", folder, folder / CONFIG_FILE)
    if cfg.hf_config is None:
        return None
    path = Path(cfg.hf_config).expanduser()
    return HFConfigSource(
        "model.hf_config", cfg.hf_config, path / CONFIG_FILE if path.is_dir() else path
    )


def read_hf_config(path: str | Path, *, key: str) -> dict[str, Any]:
    """The JSON object of ``path`` (a config.json, or the folder holding one); ``key`` names the
    setting that gave the path, for the errors."""
    path = Path(path).expanduser()
    file = path / CONFIG_FILE if path.is_dir() else path
    config = _read_json(file, key=key)
    if not isinstance(config, dict):
        raise ConfigError(f"{key}: {file} is not a JSON object (a Hugging Face config.json)")
    return config


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
    with open_safetensors(folder, SINGLE_FILE) as f:
        return {name: SINGLE_FILE for name in f.keys()}  # noqa: SIM118 (not iterable)


@dataclass(frozen=True)
class StoredTensor:
    """What a safetensors header declares of one tensor."""

    file: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' spelling: F32, BF16, ...


def stored_tensors(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor the folder's index (or single file) names, from the headers of the files:
    each file named exists, is a whole safetensors file (safetensors refuses one whose header
    declares more bytes than it holds) and holds the tensors the index puts in it."""
    files = weight_files(folder)
    by_file: dict[str, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    stored: dict[str, StoredTensor] = {}
    for file, names in sorted(by_file.items()):
        with open_safetensors(folder, file) as f:
            present = set(f.keys())  # noqa: SIM118 (not iterable)
            for name in names:
                if name not in present:
                    raise ConfigError(
                        f"model.weights: {folder / INDEX_FILE} puts {name} in {file}, which "
                        f"does not hold it"
                    )
                lazy = f.get_slice(name)
                stored[name] = StoredTensor(file, tuple(lazy.get_shape()), lazy.get_dtype())
    return stored


def check_stored(
    expected: dict[str, tuple[int, ...]],
    stored: dict[str, StoredTensor],
    folder: Path,
    *,
    optional: Iterable[str] = (),
    known: Iterable[str] | None = None,
    what: str = "the model",
) -> None:
    """``expected`` (Hugging Face name -> shape: the model this rank builds, on the meta device)
    against the folder's ``stored`` tensors. A shape that differs or a dtype that is not floating
    point, a tensor the model needs that the folder lacks (but the ``optional`` ones: a tied
    output layer), a stored one the model has no place for (outside ``known``: the whole model's
    names, where ``expected`` is a pipeline stage's): one ConfigError naming the tensor, the
    shapes and the file."""
    for name, shape in expected.items():
        entry = stored.get(name)
        if entry is None:
            continue
        where = folder / entry.file
        if entry.shape != tuple(shape):
            raise ConfigError(
                f"model.weights: {where}: tensor {name} has shape {list(entry.shape)}, where "
                f"{what} has {list(shape)} (config.json and the weights disagree)"
            )
        if entry.dtype not in FLOAT_DTYPES:
            raise ConfigError(
                f"model.weights: {where}: tensor {name} has dtype {entry.dtype}; floating-point "
                f"weights expected (quantized checkpoints are not read)"
            )
    optional = set(optional)
    missing = [name for name in expected if name not in stored and name not in optional]
    known = set(expected if known is None else known) | optional
    extra = sorted(name for name in stored if name not in known)
    problems = []
    if missing:
        problems.append(f"lacks tensors {what} needs: {listed(missing)}")
    if extra:
        problems.append(f"holds tensors {what} has no place for: {listed(extra)}")
    if problems:
        raise ConfigError(
            f"model.weights=hf:{folder} {'; and '.join(problems)} (is config.json the "
            f"checkpoint's own?)"
        )


def check_dtype_field(config: dict[str, Any], stored: dict[str, StoredTensor], source: str) -> None:
    """config.json's ``torch_dtype`` (``dtype`` from transformers 5) names the dtype the weights
    are stored in: a name that is not a floating-point dtype, or one that no stored tensor has,
    is refused (a checkpoint may keep some tensors wider, such as its norms)."""
    for field in ("dtype", "torch_dtype"):
        value = config.get(field)
        if value is None or value == "auto":
            continue
        if value not in FLOAT_DTYPES.values():
            raise ConfigError(
                f"{source}: field {field!r} is {value!r}, expected one of "
                f"{sorted(FLOAT_DTYPES.values())}"
            )
        found = sorted({FLOAT_DTYPES.get(t.dtype, t.dtype) for t in stored.values()})
        if value not in found:
            raise ConfigError(
                f"{source}: field {field!r} is {value!r}, but the weight files store "
                f"{', '.join(found)}"
            )


def listed(names: list[str]) -> str:
    """The first names of a refusal's list, and how many more."""
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


# ---------------------------------------------------------------------- reading the values


class Block(NamedTuple):
    """Where a key of an adapter's state that is not a stored tensor's own name is in the folder:
    stored tensor ``name`` from ``offsets`` on (one per dimension), in the key's shape (the up
    projection's rows of a fused ``gate_up_proj``)."""

    name: str
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class HFState:
    """What a family's state-dict adapter makes of a model: Hugging Face's names (or the keys of
    ``blocks``) -> tensors over the model's own storage (its DTensors, plain tensors, views of
    either), so that reading into them fills the model's parameters."""

    tensors: dict[str, torch.Tensor]
    blocks: dict[str, Block] = dataclasses.field(default_factory=dict)


def read_folder(state: HFState, folder: Path, stored: Mapping[str, StoredTensor]) -> int:
    """Fill ``state``'s tensors from the folder, whose headers ``stored`` were checked against the
    model (:func:`check_stored`), through DCP's ``HuggingFaceStorageReader``: each rank reads only
    the elements its tensors hold (a DTensor's local shard), converted to their dtype as they are
    copied. Tensors on the meta device (units a pipeline split gave to other ranks) are skipped.
    The bytes read."""
    tensors = {key: t for key, t in state.tensors.items() if not t.is_meta}
    sources = {
        key: (state.blocks.get(key, Block(key, (0,) * t.dim())), tuple(t.shape))
        for key, t in tensors.items()
    }
    files = sorted({stored[block.name].file for block, _ in sources.values()})
    with ExitStack() as opened:
        paths = {file: opened.enter_context(regular_file(folder, file)) for file in files}
        reader = _CheckedReader(folder, sources, stored, paths)
        with warnings.catch_warnings():
            # no_dist: a rank reads its own shards and needs nothing from the others, so no
            # collective runs and ranks whose state differs (pipeline stages, expert-parallel
            # ranks), or a process alone (export's rebuild), read alike. DCP says it assumes one
            # process.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=reader, no_dist=True)
    return reader.bytes_read


class _File(NamedTuple):
    relative_path: str  # what the stock reader's read_data opens: the checked descriptor's path


class _CheckedReader(HuggingFaceStorageReader):
    """DCP's Hugging Face reader over a checked folder. Its metadata is the checked headers of
    the tensors read, where the stock reader would open every ``*.safetensors`` in the folder
    (the index ignored) and take offsets from a header's own field; a block's key reads its
    stored tensor's elements at the block's offsets; each file is read through the descriptor
    :func:`regular_file` holds open. The reading itself is the stock reader's."""

    def __init__(
        self,
        folder: Path,
        sources: dict[str, tuple[Block, tuple[int, ...]]],
        stored: Mapping[str, StoredTensor],
        paths: dict[str, str],
    ) -> None:
        super().__init__(str(folder))
        self._sources, self._stored, self._paths = sources, stored, paths
        self.bytes_read = 0

    def _dtype(self, name: str) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, FLOAT_DTYPES[self._stored[name].dtype])
        return dtype

    def _origin(self, name: str) -> MetadataIndex:
        return MetadataIndex(name, [0] * len(self._stored[name].shape))

    def read_metadata(self) -> Metadata:
        # Each key one whole chunk; the files by the stored tensor the reads go to (a block's
        # reads are moved to it in prepare_local_plan).
        tensors: dict[str, Any] = {}
        files: dict[MetadataIndex, Any] = {}
        for key, (block, shape) in self._sources.items():
            size = torch.Size(shape)
            whole = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=size)
            properties = TensorProperties(dtype=self._dtype(block.name))
            tensors[key] = TensorStorageMetadata(properties, size, [whole])
            files[self._origin(block.name)] = _File(self._paths[self._stored[block.name].file])
        return Metadata(tensors, storage_data=files, storage_meta=StorageMeta(load_id=self.load_id))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # The stock read_data slices storage_index's tensor at storage_offsets: a block's reads
        # become reads of its stored tensor, shifted by the block's offsets.
        items = []
        for item in plan.items:
            block, _ = self._sources[item.storage_index.fqn]
            at = [offset + shift for offset, shift in zip(item.storage_offsets, block.offsets)]
            items.append(
                dataclasses.replace(
                    item, storage_index=self._origin(block.name), storage_offsets=torch.Size(at)
                )
            )
            self.bytes_read += math.prod(item.lengths) * self._dtype(block.name).itemsize
        return dataclasses.replace(plan, items=items)


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
def open_safetensors(folder: Path, name: str, *, key: str = "model.weights") -> Iterator[Any]:
    """safetensors' ``safe_open`` of ``folder/name``, a regular file there (:func:`regular_file`).
    ``key`` names the setting that gave the folder, for the errors."""
    from safetensors import SafetensorError, safe_open

    with regular_file(folder, name, key=key) as via:
        try:
            handle = safe_open(via, framework="pt")
        except (SafetensorError, OSError, ValueError) as err:
            raise ConfigError(f"{key}: {folder / name} is not a safetensors file: {err}") from None
        with handle as f:
            yield f


@contextmanager
def regular_file(folder: Path, name: str, *, key: str = "model.weights") -> Iterator[str]:
    """The path to read ``folder/name`` through, a regular file there: opened first with
    O_NOFOLLOW (a symbolic link is refused) and read through that descriptor while the context
    lasts, so the file checked is the file read."""
    path = folder / name
    if not _plain_name(name):
        raise ConfigError(f"{key}: refusing {name!r}: not a file name inside {folder}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        named = " (named by the index)" if key == "model.weights" else ""
        raise ConfigError(f"{key}: {path} does not exist{named}") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(
                f"{key}: {path} is a symbolic link; weight files must be regular files "
                f"inside the folder"
            ) from None
        raise ConfigError(f"{key}: cannot open {path}: {err.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{key}: {path} is not a regular file")
        yield f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)
    finally:
        os.close(fd)


__all__ = [
    "Block",
    "CONFIG_FILE",
    "FLOAT_DTYPES",
    "HFState",
    "HF_PREFIX",
    "INDEX_FILE",
    "SINGLE_FILE",
    "StoredTensor",
    "check_dtype_field",
    "check_stored",
    "hf_weights_folder",
    "listed",
    "open_safetensors",
    "read_folder",
    "read_hf_config",
    "regular_file",
    "stored_tensors",
    "weight_files",
]
