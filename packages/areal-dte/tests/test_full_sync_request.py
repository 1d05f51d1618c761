"""The engine side of the v2 controller's full-sync request (no AReaL needed)."""

from __future__ import annotations

from areal_dte.areal.full_sync_request import FullSyncRequest, FullSyncRequests


def test_full_sync_request_is_taken_once_for_its_version():
    """configure() records the request; it is taken once, and only for its version."""
    engine = FullSyncRequests()
    engine.configure(full_sync_version=6, reason="refused")
    other = engine.take_full_sync_request(7)
    engine.configure(full_sync_version=6, reason="refused")
    assert (None, FullSyncRequest(version=6, reason="refused"), None) == (
        other, engine.take_full_sync_request(6), engine.take_full_sync_request(6))
