"""The one error hierarchy of dte-transport."""

from __future__ import annotations


class TransportError(Exception):
    """Root of every error raised by dte-transport."""


class SyncError(TransportError, RuntimeError):
    """A version could not be delivered, not even as a full sync; the next sync is full."""

    def __init__(self, version: int, detail: str):
        self.version, self.detail = version, detail
        super().__init__(f"version {version} was not delivered: {detail}; the next sync is full")


class VersionOrderError(TransportError, ValueError):
    """A sync asked for a version not newer than the receiver's acknowledged one."""

    def __init__(self, version: int, acknowledged: int):
        self.version, self.acknowledged = version, acknowledged
        super().__init__(f"version {version} is not newer than the acknowledged {acknowledged}")


class LinkError(TransportError, ConnectionError):
    """A link could not deliver a payload or bring back the answer."""


class StagedStoreError(TransportError):
    """Root of the errors of the staged-file store (``StagedLink``, ``StagedReader``)."""


class StoreLockedError(StagedStoreError, BlockingIOError):
    """Another writer holds the store's lock; a store has one writer at a time."""

    def __init__(self, root: object):
        self.root = root
        super().__init__(f"staged store {str(root)!r} is held by another writer")


class ManifestError(StagedStoreError, ValueError):
    """A committed manifest is unreadable or inconsistent with its files."""

    def __init__(self, file: str, *, field: str, expected: object, got: object):
        self.file, self.field, self.expected, self.got = file, field, expected, got
        super().__init__(f"manifest {file!r}: {field}: expected {expected}, got {got}")


class CorruptFileError(StagedStoreError, ValueError):
    """A committed file's bytes do not match its manifest (size, digest, or missing)."""

    def __init__(self, file: str, *, version: int, field: str, expected: object, got: object):
        self.file, self.version = file, version
        self.field, self.expected, self.got = field, expected, got
        super().__init__(f"staged file {file!r} of version {version}: {field}: expected "
                         f"{expected}, got {got}")


class RejectedVersionError(StagedStoreError, RuntimeError):
    """The reader's receiver refused a committed version; it stays at its version."""

    def __init__(self, version: int, *, rejection: str, detail: str, held: int | None):
        self.version, self.rejection, self.detail, self.held = version, rejection, detail, held
        super().__init__(f"version {version} was rejected by the receiver ({rejection}): "
                         f"{detail}; it holds version {held}")


class WeightDigestError(StagedStoreError, ValueError):
    """After applying a version, a tensor's digest differs from the manifest's."""

    def __init__(self, tensor: str, *, version: int, expected: str, got: str):
        self.tensor, self.version, self.expected, self.got = tensor, version, expected, got
        super().__init__(f"tensor {tensor!r} after version {version}: digest: expected "
                         f"{expected}, got {got}; the receiver holds no version now")
