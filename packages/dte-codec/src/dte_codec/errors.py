"""The one error hierarchy of dte-codec.

Every failure of ``decode`` on arbitrary bytes, and every rejection by ``apply_``, is a
``CodecError``. Leaves also subclass the matching builtin so that callers who only know
builtins still catch them.
"""

from __future__ import annotations


class CodecError(Exception):
    """Root of every error raised by dte-codec."""


class _Located(CodecError):
    """An error about one field, optionally of one tensor, with what was expected and got."""

    def __init__(self, field: str, *, expected: object, got: object, tensor: str | None = None):
        self.field = field
        self.expected = expected
        self.got = got
        self.tensor = tensor
        where = f"tensor {tensor!r}: " if tensor is not None else ""
        super().__init__(f"{where}{field}: expected {expected}, got {got}")


class HeaderError(_Located, ValueError):
    """The payload's header is truncated, malformed or inconsistent."""


class DigestError(_Located, ValueError):
    """The payload's bytes do not match the digest in its header (corrupted in transit)."""


class EntryError(_Located, ValueError):
    """An entry's content (indices, escapes, values) is invalid."""


class MismatchError(_Located, ValueError):
    """The payload does not fit the receiver's tensors (name, dtype, shape, device)."""


class EncodeError(_Located, ValueError):
    """The sender passed tensors or change sets that cannot be encoded."""


class ApplyError(CodecError, RuntimeError):
    """Writing into the receiver's tensors failed; every touched tensor was rolled back."""


class GeometryError(_Located, ValueError):
    """A shard layout, plan or index set is inconsistent (config, shapes, boxes, ranges)."""
