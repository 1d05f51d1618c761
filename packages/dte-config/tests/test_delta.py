"""DeltaConfig: the seed's defaults, strict field types, and the method's spellings."""

from __future__ import annotations

import pytest
from dte_config import ConfigValidationError, DeltaConfig, DeltaMethod
from dte_config.delta import DiagnosticsConfig, PerformanceConfig, setting_values


def test_defaults_are_the_seeds():
    """Off by default; adamw, anchor 20, 512 MiB window, payload device, diagnostics off."""
    expected = {
        "actor.enable_delta_weight_update": False,
        "actor.weight_update_delta_method": DeltaMethod.ADAMW,
        "actor.weight_update_anchor_interval": 20,
        "actor.weight_update_delta_performance.streaming_reconstruct": True,
        "actor.weight_update_delta_performance.p2p_coalesce": True,
        "actor.weight_update_delta_performance.inversion_allreduce_window_mb": 512,
        "actor.weight_update_delta_performance.inversion_compute_on_cpu": False,
        "actor.weight_update_delta_diagnostics.snapshot_verification": False,
        "actor.weight_update_delta_diagnostics.weight_digests": False,
        "actor.weight_update_delta_diagnostics.phase_timing": False,
        "actor.weight_update_delta_diagnostics.recovery": False,
        "actor.weight_update_delta_diagnostics.deterministic_rollout": False,
    }
    assert expected == setting_values(DeltaConfig())


def test_method_spellings():
    """The methods are spelled as in YAML."""
    expected = ["adamw", "cast", "snapshot"]
    assert expected == [method.value for method in DeltaMethod]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: DeltaConfig(weight_update_delta_method="adamw"),
            "actor.weight_update_delta_method='adamw': expected one of adamw | cast | snapshot; "
            "fix: write one of adamw | cast | snapshot",
        ),
        (
            lambda: DeltaConfig(weight_update_anchor_interval=2.0),
            "actor.weight_update_anchor_interval=2.0: expected an integer, got float; "
            "fix: write an integer",
        ),
        (
            lambda: PerformanceConfig(p2p_coalesce="1"),
            "actor.weight_update_delta_performance.p2p_coalesce='1': expected true or false, "
            "got str; fix: write true or false",
        ),
        (
            lambda: DiagnosticsConfig(recovery=None),
            "actor.weight_update_delta_diagnostics.recovery=null: expected true or false, "
            "got NoneType; fix: write true or false",
        ),
        (
            lambda: DeltaConfig(weight_update_delta_performance={}),
            "actor.weight_update_delta_performance={}: expected a PerformanceConfig, got dict; "
            "fix: write a mapping of PerformanceConfig keys",
        ),
    ],
    ids=["method-as-string", "float-anchor", "string-bool", "null-bool", "dict-group"],
)
def test_python_construction_is_strict(build, message):
    """Building the classes in Python applies the same checks as loading YAML."""
    with pytest.raises(ConfigValidationError) as caught:
        build()
    assert message == str(caught.value)
