"""Change detection inside megatron-core's optimizers (no snapshot, no gathered weights).

``attach(optimizer, model, method=Method.CAST | Method.ADAMW)`` returns a `MegatronChanges`
whose ``collect()`` gives every model param of this rank its exact change set, with the
``full_reason`` contract of `areal_dte.TorchActor`. megatron-core itself is never imported
here: the hooks read the optimizer's own structures (``shards.TESTED`` versions).
"""

from .detector import MegatronChanges, attach

__all__ = ["MegatronChanges", "attach"]
