"""The one error hierarchy of dte-detector."""

from __future__ import annotations


class DetectorError(Exception):
    """Root of every error raised by dte-detector."""


class UnsupportedOptimizerError(DetectorError, ValueError):
    """The optimizer's update cannot be inverted (e.g. AMSGrad, coupled L2 decay)."""

    def __init__(self, field: str, got: object, expected: object):
        self.field, self.got, self.expected = field, got, expected
        super().__init__(f"optimizer {field}: expected {expected}, got {got!r}")


class PrecisionError(DetectorError, TypeError):
    """The inversion met a master or moment that is not fp32: its guard band bounds the
    round-off of fp32 arithmetic only."""

    def __init__(self, tensor: str, *, field: str, got: object):
        self.tensor, self.field, self.got = tensor, field, got
        super().__init__(f"tensor {tensor!r}: {field} is {got}, expected torch.float32; the "
                         "AdamW inversion's guard band holds for fp32 masters and moments only "
                         "(use the cast or snapshot detector)")


class StepGapError(DetectorError, ValueError):
    """The optimizer advanced by more than one step since the reference; cannot invert."""

    def __init__(self, tensor: str, *, previous: int, current: int):
        self.tensor, self.previous, self.current = tensor, previous, current
        super().__init__(f"tensor {tensor!r}: optimizer step went from {previous} to {current}; "
                         "the inversion covers exactly one step, sync this version in full")


class ResizedError(DetectorError, ValueError):
    """A tensor recorded by a ``CastDetector`` changed its size before the interval's
    ``clear``: its dirty bits no longer say which elements changed."""

    def __init__(self, tensor: str, *, numel: int, recorded: int):
        self.tensor, self.numel, self.recorded = tensor, numel, recorded
        super().__init__(f"tensor {tensor!r}: {numel} elements, but {recorded} when first "
                         "recorded in this interval; sync it in full and clear the detector "
                         "first")


class StateSizeError(DetectorError, ValueError):
    """An AdamW moment has another element count than its master."""

    def __init__(self, tensor: str, *, field: str, got: int, expected: int):
        self.tensor, self.field, self.got, self.expected = tensor, field, got, expected
        super().__init__(f"tensor {tensor!r}: {field} has {got} elements, the master "
                         f"{expected}")


class NoReferenceError(DetectorError, KeyError):
    """A snapshot diff was asked for a tensor that has no retained copy."""

    def __init__(self, tensor: str):
        self.tensor = tensor
        super().__init__(f"tensor {tensor!r}: no retained copy; sync it in full first")

    def __str__(self) -> str:
        return self.args[0]
