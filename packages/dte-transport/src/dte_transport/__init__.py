"""dte-transport: moving payloads and the sender/receiver state machines around them."""

from .ack import Ack, Rejection
from .errors import CorruptFileError, LinkError, StagedStoreError, SyncError, TransportError
from .loopback import Link, Loopback
from .receiver import Receiver
from .report import SyncKind, SyncReport
from .sender import Sender
from .staged import StagedLink
from .staged_reader import StagedReader

__all__ = [
    "Ack",
    "CorruptFileError",
    "Link",
    "LinkError",
    "Loopback",
    "Receiver",
    "Rejection",
    "Sender",
    "StagedLink",
    "StagedReader",
    "StagedStoreError",
    "SyncError",
    "SyncKind",
    "SyncReport",
    "TransportError",
]
