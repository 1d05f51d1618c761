"""What a receiver answers for each payload."""

from __future__ import annotations

import enum

import attrs


class Rejection(enum.Enum):
    """Why a receiver refused a payload; it stays at its version unless said otherwise."""

    BAD_PAYLOAD = "bad_payload"
    """Malformed, truncated or corrupted bytes."""
    WRONG_STREAM = "wrong_stream"
    """A delta from another sender (e.g. a restarted trainer)."""
    WRONG_BASE = "wrong_base"
    """A delta onto a version the receiver does not hold."""
    MISMATCH = "mismatch"
    """Names, dtypes or shapes that do not fit the receiver's tensors."""
    APPLY_FAILED = "apply_failed"
    """A write failed; a delta was rolled back, a full sync left no valid version."""
    DIGEST_MISMATCH = "digest_mismatch"
    """After applying, a tensor's digest differs from the sender's digest of its own
    weights (e.g. a detector missed a change); a delta was rolled back, after a full
    sync the receiver holds no valid version."""


@attrs.frozen(kw_only=True)
class Ack:
    """A receiver's answer: accepted, or rejected with a reason; and its version after."""

    accepted: bool
    version: int | None
    """The receiver's version after handling the payload (None: it holds none)."""
    rejection: Rejection | None = None
    detail: str = ""
