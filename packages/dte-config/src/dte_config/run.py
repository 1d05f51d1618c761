"""The typed root of a run's configuration: the delta path plus the RL settings it depends on."""

from __future__ import annotations

import attrs

from dte_config.delta import DeltaConfig
from dte_config.rl import RLConfig
from dte_config.validators import strict

__all__ = ["RunConfig"]


@attrs.frozen(kw_only=True)
class RunConfig:
    """What `validate` checks: the delta settings and the surrounding RL settings."""

    delta: DeltaConfig = attrs.field(default=DeltaConfig(), validator=strict(DeltaConfig))
    """The delta weight-update path (``actor.enable_delta_weight_update`` and friends)."""
    rl: RLConfig = attrs.field(default=RLConfig(), validator=strict(RLConfig))
    """The AReaL settings that the startup checks read."""
