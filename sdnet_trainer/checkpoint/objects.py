"""Checkpoints in object storage: ``checkpoint.dir`` (and ``checkpoint.resume``, export's and
serve's ``checkpoint=``) as any fsspec URL (``s3://bucket/run``, ``gs://``, ``az://``, ...), read
and written through fsspec's file systems (s3fs, gcsfs, adlfs) and DCP's own fsspec streams.

An object store has no folders and no rename, so the commit protocol of a disk (a staging folder
renamed into place, ``manager``) becomes one of objects under the step's prefix:

* every rank writes its shards straight under ``step_<n>/`` and rank 0 writes DCP's ``.metadata``;
  the step counts only once rank 0 has written ``manifest.json`` after them (one PUT: an object
  is there whole or not at all), naming every object with its size and crc32;
* a reader takes a step only with a valid manifest whose objects are all there with their sizes
  (and, when it picks one to load, their checksums): a step without one is a save that did not
  finish, never loaded;
* a step is deleted manifest first (it stops counting at once), then the rest; a save of a step
  whose prefix holds leftovers deletes them first, manifest first;
* the lock (``checkpoint.lock``) is created with a conditional PUT where the store has one
  (S3's ``If-None-Match``; fsspec's ``"xb"`` mode), so of two runs only one gets it, and renewed
  with one (S3's ``If-Match`` on the ETag its holder last wrote: ``read_versioned``, ``replace``),
  so a holder that lost it cannot write it back.

:class:`ObjectFolder` is a prefix in a store with the few ``Path`` members the checkpoint code
uses (``/``, ``name``, ``parent``) plus what a store offers instead of a directory listing and
``lstat``. Credentials come from where each store's library looks (environment, profiles,
instance metadata); ``checkpoint.storage_options`` carries the rest (an ``endpoint_url`` for
MinIO or R2, a profile name) and refuses anything that looks like a secret, since the config is
saved with the run and in every manifest.
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sdnet_trainer.errors import ConfigError

# fsspec (and a store's library) is imported when a store is first opened: runs that save to a
# disk never import it.
if TYPE_CHECKING:
    import fsspec
    from torch.distributed.checkpoint.filesystem import FileSystemBase

# A URL's protocol, as fsspec reads it (``s3://``, and chained ones such as ``simplecache::s3://``).
_PROTOCOL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)(::|://)")
# Option names that hold credentials (s3fs' key/secret/token, adlfs' account_key, sas_token and
# connection_string, botocore's aws_secret_access_key, ...): they belong in the environment or a
# profile. Identifiers such as aws_access_key_id or an SSE-KMS key id are not secrets.
_SECRET = re.compile(
    r"secret|token|password|passwd|credential|authorization|connection_?string|(^|[_-])key$",
    re.IGNORECASE,
)


def is_url(value: object) -> bool:
    """Whether ``value`` names an object store (``s3://...``) rather than a local path
    (``file://`` URLs are local paths)."""
    match = _PROTOCOL.match(str(value))
    return match is not None and match[1] not in ("file", "local")


def secret_options(options: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The keys of ``options`` (dotted, nested dicts too) that look like credentials."""
    found = []
    for key, value in options.items():
        name = f"{prefix}{key}"
        if _SECRET.search(str(key)):
            found.append(name)
        for i, item in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(item, Mapping):
                inner = f"{name}[{i}]." if isinstance(value, (list, tuple)) else f"{name}."
                found += secret_options(item, prefix=inner)
    return found


def check_url(key: str, url: str, options: Mapping[str, Any]) -> None:
    """A ConfigError naming ``key`` when ``url``'s store cannot be used from here: its library is
    not installed, or the options hold credentials."""
    if found := secret_options(options):
        raise ConfigError(
            f"checkpoint.storage_options.{found[0]}: credentials do not go in the config (it is "
            f"saved with the run and in every checkpoint's manifest); give them to the store's "
            f"library where it looks for them: the environment (AWS_ACCESS_KEY_ID and "
            f"AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, ...) or a profile"
        )
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"{key}={url!r}: cannot use {protocol}:// ({exc})") from None


def _plain(name: str) -> bool:
    """A plain object name: no folder part, nothing that leads out of the prefix."""
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name


@dataclass(frozen=True)
class ObjectFolder:
    """A prefix in an object store (``url``: ``protocol://bucket/prefix``, no trailing slash),
    opened with ``options`` (fsspec storage options). Picklable: the ranks send it to each other,
    and each opens the store itself (fsspec keeps one file system per protocol and options)."""

    url: str
    # Compared, not hashed: an option's value may be a dict (s3fs' client_kwargs).
    options: tuple[tuple[str, Any], ...] = field(default=(), hash=False)

    @classmethod
    def of(cls, url: str, options: Mapping[str, Any] | None = None) -> ObjectFolder:
        return cls(url.rstrip("/"), tuple(sorted((options or {}).items())))

    @property
    def protocol(self) -> str:
        return self.url.split("://", 1)[0]

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The store's file system, without a cache of listings: other ranks and runs write and
        delete under the prefix, and a listing (or an object's size and ETag, which opening it
        reads from the listing) served from a cache would be stale."""
        import fsspec

        return fsspec.filesystem(
            self.protocol, **{**dict(self.options), "use_listings_cache": False}
        )

    @property
    def key(self) -> str:
        """The prefix as the file system names it (no protocol)."""
        return str(self.fs._strip_protocol(self.url))

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectFolder:
        return ObjectFolder(self.url.rsplit("/", 1)[0], self.options)

    def __truediv__(self, name: str) -> ObjectFolder:
        return ObjectFolder(f"{self.url}/{name}", self.options)

    def __str__(self) -> str:
        return self.url

    # ------------------------------------------------------------------ reading

    def _object(self, name: str) -> str:
        if not _plain(name):
            raise ValueError(f"refusing object name {name!r}: not a plain name inside {self.url}")
        return f"{self.key}/{name}"

    def listing(self) -> tuple[dict[str, int], list[str]]:
        """({object name: bytes}, [sub-prefix names]) directly under this prefix, read fresh (no
        cached listing: another rank or run may have written since). Names that are not plain
        (an object store allows ``a/../b``) are left out: nothing here reads them."""
        try:
            entries = self.fs.ls(self.key, detail=True)
        except FileNotFoundError:
            return {}, []
        objects: dict[str, int] = {}
        prefixes: list[str] = []
        for entry in entries:
            name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
            if not _plain(name) or str(entry["name"]).rstrip("/") != f"{self.key}/{name}":
                continue
            if entry.get("type") == "directory":
                prefixes.append(name)
            else:
                objects[name] = int(entry.get("size") or 0)
        return objects, prefixes

    def open(self, name: str) -> io.IOBase:
        """The object ``name`` directly under this prefix, for reading."""
        return self.fs.open(self._object(name), "rb")

    def read_bytes(self, name: str) -> bytes | None:
        """The object's bytes, None when there is none."""
        try:
            return bytes(self.fs.cat_file(self._object(name)))
        except FileNotFoundError:
            return None

    def read_versioned(self, name: str) -> tuple[bytes, str] | None:
        """The object's bytes and its version, None when there is none. The version is S3's ETag
        (``_read_with_etag``); on stores without conditional replaces, a hash of the bytes (see
        ``replace``)."""
        path = self._object(name)
        try:
            if self._has_if_match:
                return self._read_with_etag(path)
            data = bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        return data, _digest(data)

    def _read_with_etag(self, path: str) -> tuple[bytes, str]:
        """s3fs reads the bytes with ``If-Match`` on the ETag it opened the object with: an
        object replaced between the two fails (and is read again) rather than pairing new bytes
        with an old ETag."""
        for attempt in range(3):
            try:
                with self.fs.open(path, "rb") as f:
                    return bytes(f.read()), str(f.details["ETag"])
            except FileNotFoundError:
                raise
            except OSError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    @property
    def _has_if_match(self) -> bool:
        """Whether the store replaces an object only if it is still at a version (S3's
        ``If-Match`` PUT, which s3fs passes through)."""
        return self.protocol in ("s3", "s3a")

    # ------------------------------------------------------------------ writing

    def write_bytes(self, name: str, data: bytes) -> None:
        """One PUT: the object is there whole or not at all."""
        self.fs.pipe_file(self._object(name), data)

    def upload(self, name: str, path: str) -> None:
        """The local file ``path`` as the object ``name``, streamed (multipart when large)."""
        self.fs.put_file(path, self._object(name))

    def create(self, name: str, data: bytes) -> bool:
        """Create the object only if there is none (a conditional PUT); False if there was one."""
        try:
            with self.fs.open(self._object(name), "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        return True

    def replace(self, name: str, data: bytes, *, version: str) -> str | None:
        """Write the object only if it is still at ``version`` (from ``read_versioned`` or an
        earlier ``replace``): its new version, or None when it is not (another writer replaced or
        deleted it). On S3 one conditional PUT (``If-Match``); on stores without one, a read, a
        comparison and a PUT, which a writer that comes in between those can still lose."""
        path = self._object(name)
        if not self._has_if_match:
            current = self.read_versioned(name)
            if current is None or current[1] != version:
                return None
            self.fs.pipe_file(path, data)
            return _digest(data)
        try:
            response = self.fs.pipe_file(path, data, IfMatch=version)
        except FileNotFoundError:
            return None
        except OSError:
            # s3fs makes S3's 412 (the precondition failed) an OSError like any other failure: the
            # object's version tells them apart.
            current = self.read_versioned(name)
            if current is None or current[1] != version:
                return None
            raise
        return str(response["ETag"])

    def remove(self, name: str) -> None:
        try:
            self.fs.rm_file(self._object(name))
        except FileNotFoundError:
            pass

    def remove_all(self, *, first: str) -> None:
        """Every object under this prefix, the object ``first`` (a step's manifest) before the
        others: a deletion cut short then leaves no step that counts with objects missing."""
        self.remove(first)
        try:
            self.fs.rm(self.key, recursive=True)
        except FileNotFoundError:
            pass


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dcp_file_system(folder: ObjectFolder) -> FileSystemBase:
    """DCP's fsspec file system on ``folder``'s store, opened with its storage options (DCP's own
    opens each URL it is given with none)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    files = FileSystem()
    files.fs = folder.fs
    return files
