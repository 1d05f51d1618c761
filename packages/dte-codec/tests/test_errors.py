"""The error hierarchy: one root, leaves that are also builtins, messages from fields."""

from __future__ import annotations

import pytest
from dte_codec import CodecError
from dte_codec.errors import (ApplyError, DigestError, EncodeError, EntryError, HeaderError,
                              MismatchError, _Located)

LOCATED = sorted(_Located.__subclasses__(), key=lambda e: e.__name__)
"""Every error about one field; at least the five below."""


def test_located_errors_include_the_codec_leaves():
    """The header, digest, entry, mismatch and encode errors are all located errors."""
    assert {HeaderError, DigestError, EntryError, MismatchError, EncodeError} <= set(LOCATED)


@pytest.mark.parametrize("error", LOCATED, ids=lambda e: e.__name__)
def test_located_errors_are_value_errors(error):
    """Every located error is a ``CodecError`` and a ``ValueError``."""
    assert issubclass(error, CodecError) and issubclass(error, ValueError)


def test_apply_error_is_runtime_error():
    """``ApplyError`` is a ``CodecError`` and a ``RuntimeError``."""
    assert issubclass(ApplyError, CodecError) and issubclass(ApplyError, RuntimeError)


@pytest.mark.parametrize("error", LOCATED, ids=lambda e: e.__name__)
def test_message_with_tensor(error):
    """The message names the tensor, the field, what was expected and what was got."""
    exc = error("indices", expected="inside [0, 10)", got="[0, 10]", tensor="layers.3.w1")
    assert "tensor 'layers.3.w1': indices: expected inside [0, 10), got [0, 10]" == str(exc)
    assert ("indices", "inside [0, 10)", "[0, 10]", "layers.3.w1") == (
        exc.field, exc.expected, exc.got, exc.tensor)


def test_message_without_tensor():
    """Header-level errors have no tensor prefix."""
    exc = HeaderError("magic", expected=b"DTEP", got=b"XXXX")
    assert "magic: expected b'DTEP', got b'XXXX'" == str(exc)
    assert exc.tensor is None
