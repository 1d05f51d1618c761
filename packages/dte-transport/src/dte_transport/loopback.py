"""An in-process link: hands each payload's frame straight to a receiver."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from dte_codec import Frame

from .ack import Ack
from .receiver import Receiver


class Link(Protocol):
    """Delivers one payload (a ``dte_codec.Frame``) to the receiving side and returns its
    answer.

    A link that can check the result against the sender's own weights also takes
    ``digests`` (``dte_codec.digests`` of them, by name) and refuses a version that does
    not match (``Loopback``, ``StagedLink``); ``Sender(digests=True)`` passes them.
    """

    def send(self, frame: Frame) -> Ack: ...


class Loopback:
    """A ``Link`` to a ``Receiver`` in the same process, counting what it carried; the
    frame itself is handed over, its body where the sender encoded it (no host copy)."""

    def __init__(self, receiver: Receiver):
        self.receiver = receiver
        self.messages = 0
        self.bytes_sent = 0

    def send(self, frame: Frame, *, digests: Mapping[str, str] | None = None) -> Ack:
        self.messages += 1
        self.bytes_sent += frame.nbytes
        return self.receiver.receive(frame, digests=digests)
