"""Data in tar shards (the WebDataset layout), local or behind any fsspec URL, read with random
access so that the global-index sampler, ``set_epoch`` and exact resume on any world size work
exactly as they do for a folder of files.

A shard is a plain tar whose members are grouped into samples by key (the member name up to the
first dot of its base name): ``KEY.jpg`` (or ``.png``, ``.webp``, any image type ImageFolder
reads) plus ``KEY.cls`` (the label as a decimal integer) or ``KEY.json`` (an object with an
integer ``label``) make a labelled image (:class:`ShardImages`, with ``data=imagefolder``'s
transforms, from ``data.augment``); ``KEY.txt`` alone makes a text sample, and a shard set of
text samples is read as byte-level language-model windows like ``data=text``
(:class:`ShardText`).

Random access comes from an index per shard, ``SHARD.tar.idx.json`` next to it: for every sample
its key, the member's extension, the offset of the member's bytes in the tar, their length and
the label (null for text). The converter writes it; for shards made elsewhere it is built once by
scanning the tar and cached on local disk (``$SDNET_CACHE_DIR`` or ``~/.cache/sdnet_trainer``).
Image ``i`` is then one range read of the member's tar header plus its bytes: the header is
checked against the index (checksum, size, name), so an index that does not describe its tar is
caught at the first read instead of feeding wrong bytes to the decoder.

Everything read from the shards and their indexes is untrusted: a malformed index is a
:class:`ConfigError` naming the shard, the entry and the field, raised when the data set is
built; a member that cannot be read (the shard is truncated) or decoded follows
``data.on_bad_sample`` as a bad file of an ImageFolder does, with a message naming the shard and
the key. A failure to reach the storage (network, permissions) is not a bad sample: it raises.

Convert an ImageFolder (its ``train/`` and ``val/``), or ``train/`` and ``val/`` folders of
``.txt`` files, with::

    python -m sdnet_trainer.data.shards SRC OUT [shard_size=N]

(``shard_size``: samples per shard, 10,000 by default) which writes
``OUT/train/train-000000.tar`` (+ ``.idx.json``), ..., ``OUT/val/...`` and, for images,
``OUT/classes.json``; it keeps ImageFolder's sample order (sample ``i`` of the shards is sample
``i`` of the folder), or ``data=text``'s file order, and skips, when run again, the shards
already written from the same files.

The package, one concern a module: :mod:`.index` (the shard index: parse, scan, cache),
:mod:`.listing` (shard sets, brace patterns, ``classes.json``), :mod:`.reading` (range reads
and the tar header check), :mod:`.images` and :mod:`.text` (the data sets), :mod:`.build`
(``data.name=shards``), :mod:`.write` and :mod:`.cli` (the converter and its command line).
"""

from sdnet_trainer.data.shards.build import build_shards
from sdnet_trainer.data.shards.cli import main
from sdnet_trainer.data.shards.images import ShardImages
from sdnet_trainer.data.shards.index import (
    INDEX_SUFFIX,
    ShardError,
    ShardIndex,
    load_index,
    parse_index,
    scan_shard,
)
from sdnet_trainer.data.shards.listing import expand_braces
from sdnet_trainer.data.shards.text import ShardText
from sdnet_trainer.data.shards.write import DEFAULT_SHARD_SIZE, convert

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "INDEX_SUFFIX",
    "ShardError",
    "ShardImages",
    "ShardIndex",
    "ShardText",
    "build_shards",
    "convert",
    "expand_braces",
    "load_index",
    "main",
    "parse_index",
    "scan_shard",
]
