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
