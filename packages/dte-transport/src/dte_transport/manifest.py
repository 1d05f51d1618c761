"""The manifest of one staged version, and which committed versions form the current chain.

A store is one directory. Each version is a set of data files plus one manifest
``<sequence>.manifest.json``, written last; a version without a manifest does not exist.
``sequence`` counts commits in the store (versions of a new stream may restart at 1).
Names starting with ``.`` (temporary files, the writer's lock) are never read.

Manifest fields (JSON object):

| key | meaning |
|---|---|
| `format`, `format_version` | `"dte-staged"`, 1 |
| `sequence` | commit number in this store, strictly increasing |
| `stream_id`, `version` | the payload's stream and version |
| `kind` | `full` (first version of a stream here), `anchor` (a later full), `delta` |
| `base_version` | the version a delta applies onto; null for full and anchor |
| `files` | `[{"name", "size", "xxh3_128"}]`: every data file, digest of its bytes |
| `tensors` | `{name: digest}`: `dte_codec.digests` of the weights after this version |
"""

from __future__ import annotations

import enum
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import attrs

from .errors import ManifestError

FORMAT = "dte-staged"
FORMAT_VERSION = 1
MANIFEST_SUFFIX = ".manifest.json"
SEQUENCE_WIDTH = 12
"""Digits of the zero-padded sequence that starts every file name of a version."""
HIDDEN_PREFIX = "."
"""Temporary files and the lock file start with this; readers skip them."""
_MANIFEST_NAME = re.compile(r"^(\d+)" + re.escape(MANIFEST_SUFFIX) + "$")


class StoredKind(enum.Enum):
    FULL = "full"
    """A full version, the first of its stream in this store."""
    ANCHOR = "anchor"
    """A full version of a stream the store already held; older versions are pruned."""
    DELTA = "delta"


@attrs.frozen(kw_only=True)
class StagedFile:
    """One data file of a version: its name in the store, size and xxh3-128 of its bytes."""

    name: str
    size: int
    xxh3_128: str


@attrs.frozen(kw_only=True)
class Manifest:
    """What one committed version consists of."""

    sequence: int
    stream_id: str
    version: int
    kind: StoredKind
    base_version: int | None
    """The version a delta applies onto; None for full and anchor versions."""
    files: tuple[StagedFile, ...]
    tensors: dict[str, str]
    """Digest of every tensor after this version (``dte_codec.digests``)."""

    @property
    def name(self) -> str:
        """The manifest's file name."""
        return manifest_name(self.sequence)

    @property
    def is_full(self) -> bool:
        return self.kind is not StoredKind.DELTA

    def to_json(self) -> bytes:
        doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "sequence": self.sequence,
               "stream_id": self.stream_id, "version": self.version, "kind": self.kind.value,
               "base_version": self.base_version,
               "files": [attrs.asdict(f) for f in self.files], "tensors": self.tensors}
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes, *, file: str) -> Manifest:
        """Parse a manifest; raise ``ManifestError`` naming the first bad field."""
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(file, field="json", expected="a JSON object", got=exc) from None
        _field(file, doc, "format", FORMAT, lambda v: v == FORMAT)
        _field(file, doc, "format_version", FORMAT_VERSION, lambda v: v == FORMAT_VERSION)
        kind = _field(file, doc, "kind", [k.value for k in StoredKind],
                      lambda v: v in {k.value for k in StoredKind})
        delta = kind == StoredKind.DELTA.value
        base = _field(file, doc, "base_version", "an int >= 0" if delta else None,
                      (lambda v: _is_count(v)) if delta else (lambda v: v is None))
        return cls(sequence=_field(file, doc, "sequence", "an int >= 0", _is_count),
                   stream_id=_field(file, doc, "stream_id", "a string",
                                    lambda v: isinstance(v, str)),
                   version=_field(file, doc, "version", "an int >= 0", _is_count),
                   kind=StoredKind(kind), base_version=base,
                   files=tuple(StagedFile(**f) for f in _field(
                       file, doc, "files", "a list of {name, size, xxh3_128}", _is_file_list)),
                   tensors=_field(file, doc, "tensors", "an object of digests", _is_digest_map))


def manifest_name(sequence: int) -> str:
    return f"{sequence:0{SEQUENCE_WIDTH}d}{MANIFEST_SUFFIX}"


def committed(root: Path) -> list[Manifest]:
    """Every committed manifest in ``root``, in commit order.

    Raises:
        FileNotFoundError: a listed manifest was pruned before it could be read; the
            listing may predate a newer full version, so list again.
        ManifestError: a manifest is unreadable or invalid.
    """
    found = []
    for entry in os.listdir(root):
        match = _MANIFEST_NAME.match(entry)
        if match is None:
            continue
        manifest = Manifest.from_json((root / entry).read_bytes(), file=entry)
        if manifest.sequence != int(match.group(1)):
            raise ManifestError(entry, field="sequence", expected=int(match.group(1)),
                                got=manifest.sequence)
        found.append(manifest)
    return sorted(found, key=lambda m: m.sequence)


def current_chain(manifests: Sequence[Manifest]) -> list[Manifest]:
    """The latest full version and the deltas committed after it, in order.

    Raises:
        ManifestError: a delta after it is of another stream or not onto the one before.
    """
    fulls = [i for i, m in enumerate(manifests) if m.is_full]
    if not fulls:
        return []
    chain = [manifests[fulls[-1]]]
    for manifest in manifests[fulls[-1] + 1:]:
        previous = chain[-1]
        if manifest.stream_id != previous.stream_id:
            raise ManifestError(manifest.name, field="stream_id",
                                expected=repr(previous.stream_id), got=repr(manifest.stream_id))
        if manifest.base_version != previous.version:
            raise ManifestError(manifest.name, field="base_version", expected=previous.version,
                                got=manifest.base_version)
        chain.append(manifest)
    return chain


def _field(file: str, doc: object, key: str, expected: object, ok) -> object:
    value = doc.get(key, ...) if isinstance(doc, dict) else ...
    if value is ... or not ok(value):
        raise ManifestError(file, field=key, expected=expected,
                            got="nothing" if value is ... else repr(value))
    return value


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_file_list(value: object) -> bool:
    keys = {f.name for f in attrs.fields(StagedFile)}
    return isinstance(value, list) and all(
        isinstance(f, dict) and set(f) == keys and isinstance(f["name"], str)
        and _is_safe_name(f["name"]) and _is_count(f["size"]) and isinstance(f["xxh3_128"], str)
        for f in value)


def _is_safe_name(name: str) -> bool:
    """A plain file name inside the store: no directories, not hidden."""
    return bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def _is_digest_map(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
