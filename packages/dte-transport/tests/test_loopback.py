"""Loopback link and the public API of dte_transport."""

import dte_transport
import torch
from dte_codec import encode_full
from dte_transport import Loopback, Receiver


def test_loopback_counts_messages_and_bytes():
    """Each send reaches the receiver and is counted."""
    receiver = Receiver({"w": torch.zeros(4)})
    link = Loopback(receiver)
    frame = encode_full({"w": torch.ones(4)}, stream_id="s", version=1)
    ack = link.send(frame)
    assert (True, 1, 1, len(bytes(frame))) == (ack.accepted, receiver.version, link.messages,
                                               link.bytes_sent)


def test_public_api():
    """The package root exports exactly its documented names."""
    expected = {"Ack", "CorruptFileError", "Link", "LinkError", "Loopback", "Receiver",
                "Rejection", "Sender", "StagedLink", "StagedReader", "StagedStoreError",
                "SyncError", "SyncKind", "SyncReport", "TransportError"}
    assert expected == set(dte_transport.__all__)
