"""dte-codec: what the bytes of a weight sync mean.

A payload is full (every tensor dense) or a delta from one version to the next (per
tensor the cheapest exact encoding); in flight it is a ``Frame``, a host header and a
body on the device where it was encoded. ``decode`` validates everything it can on its own
(``decode_queued`` leaves the device's checks queued for a reader that reads them with its
own values), ``apply_`` checks the payload against the receiver and writes all or nothing.
"""

from .apply import apply_
from .decode import decode, decode_queued
from .digest import digests
from .encode import ChangeSet, encode_delta, encode_full
from .encodings import Kind
from .errors import CodecError
from .frame import Frame
from .header import Header
from .payload import Payload
from .warmup import warm_up

__all__ = [
    "ChangeSet",
    "CodecError",
    "Frame",
    "Header",
    "Kind",
    "Payload",
    "apply_",
    "decode",
    "decode_queued",
    "digests",
    "encode_delta",
    "encode_full",
    "warm_up",
]
