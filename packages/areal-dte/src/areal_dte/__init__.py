"""areal-dte: the delta weight-sync path wired into trainers and rollout engines.

Now: ``TorchActor``, the trainer side of a plain torch loop (fp32 masters, a bf16 model
copy, any of the three detectors, a ``dte_transport.Sender``). The Megatron-core actor,
the SGLang receiver and the AReaL wiring build on the same pieces.
"""

from .torch_actor import Method, TorchActor

__all__ = ["Method", "TorchActor"]
