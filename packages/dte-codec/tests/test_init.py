"""The public surface of ``dte_codec``."""

from __future__ import annotations

import dte_codec


def test_all_is_pinned():
    """``__all__`` is exactly this set; adding or removing a public name fails here."""
    assert ["ChangeSet", "CodecError", "Frame", "Header", "Kind", "Payload", "apply_", "decode",
            "decode_queued", "digests", "encode_delta", "encode_full", "warm_up"
            ] == sorted(dte_codec.__all__)


def test_every_public_name_exists():
    """Every name in ``__all__`` is an attribute of the package."""
    assert [] == [name for name in dte_codec.__all__ if not hasattr(dte_codec, name)]


def test_kind_values():
    """The wire values of ``Kind``: FULL is 0, DELTA is 1."""
    assert {"FULL": 0, "DELTA": 1} == {k.name: k.value for k in dte_codec.Kind}
