"""A `dte_transport.Link` over AReaL's xccl weight-update group.

In ``connect_engine`` AReaL 1.0.4's Megatron engine opens an NCCL group from the actor's
pipeline head (rank 0) to every TP worker of every SGLang server, and the rollout joins a
broadcast when asked through the engine's rollout handle
(``update_weights_from_distributed(meta, param_specs)``, which returns a future).
`XcclLink` sends one payload as one such broadcast of one uint8 tensor, the payload's
bytes under ``sglang_receiver.PAYLOAD_TENSOR`` (``sglang_receiver.payload_tensors``).
SGLang receives it in its ``update_weights_from_distributed`` and passes
``[(PAYLOAD_TENSOR, tensor)]`` to the model's ``load_weights``, where the rollout side must
apply it (the seam is described in the package README).

SGLang answers success or failure, not the receiver's ack: a failure raises `LinkError`, a
success counts as the payload accepted. A model whose ``load_weights`` skips names it does
not know would answer success for a payload it never applied, so `check` first sends bytes
that are no payload and requires the rollout to refuse them.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import torch
import torch.distributed as dist
from dte_codec import Frame, Header
from dte_transport import Ack, LinkError

from .areal_import import areal_module
from .errors import REFUSAL, DeltaSyncError
from .sglang_receiver import payload_tensors

__all__ = ["XcclLink"]

log = logging.getLogger(__name__)

PROBE = b"not a dte payload"
"""What `check` sends: any receiver of payloads refuses it."""


@attrs.frozen(kw_only=True)
class XcclLink:
    """Delivers payloads as broadcasts over AReaL's weight-update group."""

    rollout: Any
    """The engine's rollout handle (AReaL's ``RolloutCallback`` in a train worker)."""
    meta: Any
    """The ``WeightUpdateMeta`` the group was set up with (``nccl_group_name`` filled in)."""
    group: Any
    """The NCCL process group; this process broadcasts as its rank 0."""
    device: torch.device
    """Where the payload tensor is put for the broadcast."""

    def send(self, frame: Frame) -> Ack:
        """Broadcast one payload to every rollout TP worker; their success is the ack.
        The update request carries one uint8 tensor, so the frame travels as its bytes.

        Raises:
            LinkError: a rollout server answered failure, or the broadcast failed.
        """
        data = bytes(frame)
        header, _ = Header.unpack(memoryview(data))
        self._deliver(data)
        return Ack(accepted=True, version=header.payload_version)

    def check(self) -> None:
        """Make sure the rollout applies payloads: areal-dte's receiver must refuse bytes
        that are none (a refusal for another reason, e.g. an SGLang that takes updates
        only inside a weight-update session, does not count).

        Raises:
            DeltaSyncError: the rollout answered success (it would skip payloads too), or
                refused for a reason that is not the receiver's.
        """
        try:
            self._deliver(PROBE)
        except LinkError as refused:
            if REFUSAL in str(refused):
                log.info("the rollout refuses what is no payload, as it must: %s", refused)
                return
            raise DeltaSyncError("the rollout's answer to bytes that are no payload",
                                 expected=f"areal_dte's receiver refusing them ({REFUSAL!r})",
                                 got=str(refused)) from refused
        raise DeltaSyncError(
            "the rollout's answer to bytes that are no payload",
            expected="a refusal (areal_dte.sglang_receiver applying payloads in load_weights)",
            got="success, so it ignores payloads")

    def _deliver(self, data: bytes) -> None:
        [(name, tensor)] = payload_tensors(data)
        spec = areal_module("areal.api").ParamSpec(
            name=name, shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."))
        try:
            answer = self.rollout.update_weights_from_distributed(self.meta, [spec])
            dist.broadcast(tensor.to(self.device), src=0, group=self.group)
            answer.result()
        except Exception as exc:  # the process edge: HTTP and NCCL failures, re-raised typed
            raise LinkError(f"{len(data)} B not delivered over {self.meta.nccl_group_name}: "
                            f"{exc}") from exc
