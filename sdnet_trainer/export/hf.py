"""``format=hf``: a model of a family with a Hugging Face adapter (the Llama's) as a Hugging Face
checkpoint folder, which ``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads as it is.

Written: ``config.json`` (the architecture, the family's ``hf.config``: the Llama's
``models/llama/hf.py`` ``hf_config_of``), the weights under Hugging Face's names (``hf.tensors``:
the family's state-dict adapter) in safetensors shards of at most :data:`SHARD_BYTES`
(``model-00001-of-0000N.safetensors``) with their index ``model.safetensors.index.json``, both
written by torch's DCP through its ``HuggingFaceStorageWriter``, and the run's tokenizer files
when its config names a local tokenizer (``data.tokenizer``: a folder holding them, or a
``tokenizer.json``). A run that started from a Hugging Face folder (``model.weights=hf:PATH`` or
``model.hf_config``) passes on that config's special token ids and its
``generation_config.json``; otherwise the ids are null (transformers' defaults, 1 and 2, are not
Llama 3's). A tied output layer is stored once, as the embedding, and ``tie_word_embeddings``
says so. The tensors keep the checkpoint's dtype (float32 for a run's weights and its average).
Every file goes into the export's staging folder, published by renames once all are written
(``export/output.py``): a failed write leaves no half-written folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from sdnet_trainer.data.tokenizer import load_tokenizer
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export.writers import ExportError
from sdnet_trainer.models.family import ModelFamily
from sdnet_trainer.models.hf_folder import INDEX_FILE, hf_weights_folder, read_hf_config
from sdnet_trainer.models.registry import FAMILIES

logger = logging.getLogger(__name__)

HF_CONFIG = "config.json"
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
# A tokenizer's files as transformers saves them; those present are copied.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)


def hf_file_names() -> list[str]:
    """The files every ``format=hf`` export writes (the shards' names depend on the size)."""
    return [HF_CONFIG, INDEX_FILE]


def write_hf(
    model: nn.Module,
    folder: Path,
    *,
    family: ModelFamily | None,
    tokenizer: str | None = None,
    source: Path | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> list[str]:
    """Write ``model`` as a Hugging Face folder into ``folder`` through its family's adapter
    (``family.hf``: the Llama's); the names written. ``source``: the Hugging Face config.json
    (or its folder) the run started from."""
    if family is None or family.hf is None:
        with_adapter = sorted(name for name, f in FAMILIES.items() if f.hf is not None)
        raise ExportError(
            f"format=hf writes the model families with a Hugging Face adapter "
            f"(model.name={' or '.join(with_adapter)}); this checkpoint's model is a "
            f"{type(model).__name__}: use format=pt or safetensors"
        )
    tensors = {
        name: value.detach().contiguous() for name, value in family.hf.tensors(model).items()
    }
    dtype = next(iter(tensors.values())).dtype
    # Each tensor's file, 1..N: DCP's Hugging Face writer names them model-0000i-of-0000N and
    # writes the index beside them (weight_map, metadata.total_size), as transformers does.
    shards = _shards(tensors, shard_bytes)
    files = {name: i for i, names in enumerate(shards, start=1) for name in names}
    writer = HuggingFaceStorageWriter(str(folder), fqn_to_index_mapping=files)
    with warnings.catch_warnings():
        # One process writes the whole model; DCP says it assumes one process.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=writer, no_dist=True)
    index = json.loads((folder / INDEX_FILE).read_text())
    written = sorted(set(index["weight_map"].values()))
    config = {**family.hf.config(model, dtype), **_token_ids(source)}
    (folder / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    written += [INDEX_FILE, HF_CONFIG]
    if source is not None:
        written += _copy_files((source if source.is_dir() else source.parent), folder, _GENERATION)
    if tokenizer:
        written += copy_tokenizer(Path(tokenizer).expanduser(), folder)
    return written


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Names in order, cut into runs of at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


# The tokenizer itself: beside a single tokenizer file, only its config files are taken.
_MAIN_FILES = ("tokenizer.json", "tokenizer.model")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_GENERATION = ("generation_config.json",)


def _token_ids(source: Path | None) -> dict[str, Any]:
    ids: dict[str, Any] = dict.fromkeys(_TOKEN_IDS)
    if source is None:
        return ids
    try:
        config = read_hf_config(source, key="the run's Hugging Face config")
    except ConfigError as err:
        logger.warning("format=hf: special token ids not carried over: %s", err)
        return ids
    for key in _TOKEN_IDS:
        value = config.get(key)
        ok = isinstance(value, int) or (
            isinstance(value, list) and all(isinstance(v, int) for v in value)
        )
        ids[key] = value if ok and not isinstance(value, bool) else None
    return ids


def source_config(cfg: Any) -> Path | None:
    """The Hugging Face config the run started from (``model.weights=hf:`` or
    ``model.hf_config``), if any."""
    model = getattr(cfg, "model", None)
    if model is None:
        return None
    folder = hf_weights_folder(getattr(model, "weights", None))
    if folder is not None:
        return folder
    hf_config = getattr(model, "hf_config", None)
    return Path(hf_config).expanduser() if hf_config else None


def copy_tokenizer(source: Path, folder: Path) -> list[str]:
    """The tokenizer files of ``source`` (a folder of them, or one tokenizer file) copied into
    ``folder``: regular files only, never through a link, and only under the names of
    :data:`TOKENIZER_FILES` (the source's own file name is never used, so no path the run's
    config names can overwrite a weight shard or config.json). One file is copied only if it reads
    as a tokenizer (:func:`~sdnet_trainer.data.tokenizer.load_tokenizer`), as ``tokenizer.json``
    (a fast tokenizer) or ``tokenizer.model`` (a tiktoken BPE file), with the tokenizer config
    files beside it that ``data.tokenizer`` read too. A tokenizer named by a hub id (not a local
    path) is not copied, with a warning."""
    if source.is_symlink() and not source.is_dir():
        logger.warning("format=hf: data.tokenizer=%r is a link; not copied", str(source))
        return []
    if source.is_file():
        # A file of any name: copied only once it reads as a tokenizer, so that a path in the
        # run's config cannot bring another file (a key, a password file) into the export.
        try:
            load_tokenizer(str(source))
        except ConfigError as err:
            logger.warning("format=hf: data.tokenizer not copied: %s", err)
            return []
        name = "tokenizer.json" if source.suffix == ".json" else "tokenizer.model"
        beside = {n: source.parent / n for n in TOKENIZER_FILES if n not in _MAIN_FILES}
        files = {**beside, name: source}
    elif source.is_dir():
        files = {name: source / name for name in TOKENIZER_FILES}
    else:
        logger.warning(
            "format=hf: data.tokenizer=%r is not a local file or folder; the export holds no "
            "tokenizer files (save the tokenizer beside the model to serve it)",
            str(source),
        )
        return []
    copied = _copy(files, folder)
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        logger.warning("format=hf: %s holds no tokenizer.json or tokenizer.model", source)
    return copied


def _copy_files(source: Path, folder: Path, names: tuple[str, ...]) -> list[str]:
    return _copy({name: source / name for name in names}, folder)


def _copy(files: dict[str, Path], folder: Path) -> list[str]:
    """Copy each existing regular file (never through a link) to ``folder/name``."""
    copied = []
    for name, path in files.items():
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode):
            logger.warning("format=hf: %s is not a regular file; not copied", path)
            continue
        shutil.copyfile(path, folder / name, follow_symlinks=False)
        copied.append(name)
    return copied


def tokenizer_of(cfg: Any) -> str | None:
    """The run's tokenizer path (``data.tokenizer``), if its config has one."""
    data = getattr(cfg, "data", None)
    value = getattr(data, "tokenizer", None) if data is not None else None
    return str(value) if value else None


__all__ = [
    "HF_CONFIG",
    "SHARD_BYTES",
    "copy_tokenizer",
    "hf_file_names",
    "source_config",
    "tokenizer_of",
    "write_hf",
]
