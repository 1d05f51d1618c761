"""dte-transport: moving payloads and the sender/receiver state machines around them."""

from .ack import Ack, Rejection
from .errors import LinkError, SyncError, TransportError
from .loopback import Link, Loopback
from .receiver import Receiver
from .report import SyncKind, SyncReport
from .sender import Sender

__all__ = [
    "Ack",
    "Link",
    "LinkError",
    "Loopback",
    "Receiver",
    "Rejection",
    "Sender",
    "SyncError",
    "SyncKind",
    "SyncReport",
    "TransportError",
]
