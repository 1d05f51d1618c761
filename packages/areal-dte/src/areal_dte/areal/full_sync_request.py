"""The controller's request that a train engine send a version in full, and its reason.

After a rollout refused a version, `controller_v2.DeltaActorControllerV2` asks every train
worker to send that version again in full. AReaL 1.0.4's v2 train worker reaches its
engine through fixed routes only; the one meant for engine-specific settings is
``/configure``, which calls ``engine.configure(*args, **kwargs)`` when the engine has it.
`FullSyncRequests` gives the engine that method; the weight-update adapter takes the
request when it sends the version.
"""

from __future__ import annotations

import logging

import attrs

__all__ = ["FullSyncRequest", "FullSyncRequests"]

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class FullSyncRequest:
    """Send ``version`` in full, because of ``reason``."""

    version: int = attrs.field(validator=attrs.validators.instance_of(int))
    """The version to send in full."""
    reason: str = attrs.field(validator=attrs.validators.instance_of(str))
    """Why, e.g. the rollout's refusal text."""


class FullSyncRequests:
    """Mixin for a train engine: holds the controller's latest `FullSyncRequest`."""

    _full_sync_request: FullSyncRequest | None = None

    def configure(self, *, full_sync_version: int, reason: str) -> None:
        """Record that ``full_sync_version`` goes in full (AReaL's ``/configure`` route)."""
        request = FullSyncRequest(version=full_sync_version, reason=reason)
        log.warning("v%d will be sent in full: %s", request.version, request.reason)
        self._full_sync_request = request

    def take_full_sync_request(self, version: int) -> FullSyncRequest | None:
        """The request for ``version``, cleared once taken; None when there is none.

        A request for another version is dropped: it was for an update that is over.
        """
        request, self._full_sync_request = self._full_sync_request, None
        return request if request is not None and request.version == version else None
