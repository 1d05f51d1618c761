"""Durable file writes (temporary name, fsync, rename, directory fsync) and verified reads."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import xxhash

from .errors import CorruptFileError
from .manifest import HIDDEN_PREFIX, StagedFile

TEMP_PREFIX = HIDDEN_PREFIX + "tmp-"


def file_digest(data: bytes | memoryview) -> str:
    """xxh3-128 hex digest of a file's bytes."""
    return xxhash.xxh3_128_hexdigest(data)


def write_durable(root: Path, name: str, data: bytes | memoryview, *,
                  before_rename: Callable[[], None] | None = None) -> StagedFile:
    """Write ``data`` as ``root/name``: under a temporary name, fsynced, then renamed.

    The directory entry is made durable by the caller (``fsync_dir``), once per batch.
    """
    temp = root / f"{TEMP_PREFIX}{uuid.uuid4().hex}-{name}"
    try:
        with open(temp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(temp, root / name)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    return StagedFile(name=name, size=len(data), xxh3_128=file_digest(data))


def fsync_dir(root: Path) -> None:
    """Make renames and unlinks in ``root`` durable."""
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_verified(root: Path, staged: StagedFile, *, version: int) -> bytes:
    """The bytes of a committed file, checked against its size and digest.

    Raises:
        FileNotFoundError: the file is gone (pruned, or deleted by hand).
        CorruptFileError: size or digest differ from the manifest.
    """
    data = (root / staged.name).read_bytes()
    if len(data) != staged.size:
        raise CorruptFileError(staged.name, version=version, field="size",
                               expected=f"{staged.size} bytes", got=f"{len(data)} bytes")
    got = file_digest(data)
    if got != staged.xxh3_128:
        raise CorruptFileError(staged.name, version=version, field="xxh3_128",
                               expected=staged.xxh3_128, got=got)
    return data
