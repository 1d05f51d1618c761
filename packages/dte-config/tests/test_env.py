"""DTE_* variables: export into the process and every scheduling spec, read back in workers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from dte_config import ConfigValidationError, DeltaConfig, DeltaMethod, export_env, read_env
from dte_config.delta import DiagnosticsConfig, PerformanceConfig, setting_fields
from dte_config.env import ENV_NAMES
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf

SEED_NAMES = {
    "DTE_STREAMING_RECONSTRUCT",
    "DTE_DELTA_P2P_COALESCE",
    "DTE_INVERSION_ALLREDUCE_WINDOW_MB",
    "DTE_INVERSION_COMPUTE_ON_CPU",
}

performance = st.builds(
    PerformanceConfig,
    streaming_reconstruct=st.booleans(),
    p2p_coalesce=st.booleans(),
    inversion_allreduce_window_mb=st.integers(min_value=1),
    inversion_compute_on_cpu=st.booleans(),
)
diagnostics = st.builds(
    DiagnosticsConfig,
    snapshot_verification=st.booleans(),
    weight_digests=st.booleans(),
    phase_timing=st.booleans(),
    recovery=st.booleans(),
    deterministic_rollout=st.booleans(),
)
deltas = st.builds(
    DeltaConfig,
    enable_delta_weight_update=st.booleans(),
    weight_update_delta_method=st.sampled_from(DeltaMethod),
    weight_update_anchor_interval=st.integers(min_value=0),
    weight_update_delta_performance=performance,
    weight_update_delta_diagnostics=diagnostics,
)


@given(deltas)
def test_round_trip_is_identity(delta):
    """config -> DTE_* variables -> config gives back the same config."""
    environ: dict[str, str] = {}
    export_env(delta, environ=environ, tree={})
    assert delta == read_env(environ)


@given(deltas, st.dictionaries(st.from_regex(r"\A[A-CE-Z][A-Z_]{0,8}\Z"), st.text()))
def test_other_variables_are_ignored(delta, others):
    """Variables without the DTE_ prefix neither disturb nor survive the round trip."""
    environ = dict(others)
    export_env(delta, environ=environ, tree={})
    assert delta == read_env(environ)


def test_every_setting_has_one_variable():
    """Each leaf setting maps to exactly one DTE_* name, and the seed's names are kept."""
    expected = (set(setting_fields()), len(ENV_NAMES), True)
    names = set(ENV_NAMES.values())
    assert expected == (set(ENV_NAMES), len(names), SEED_NAMES <= names)


def test_export_writes_process_and_every_spec(example_path):
    """export_env fills the environment and each scheduling spec of the tree alike."""
    from dte_config import load_config

    loaded = load_config(example_path, [])
    environ: dict[str, str] = {"PATH": "/bin"}
    written = export_env(loaded.config.delta, environ=environ, tree=loaded.tree)
    specs = [loaded.tree[role].scheduling_spec[0].env_vars for role in ("actor", "rollout", "ref")]
    expected = [written] * 3 + [written | {"PATH": "/bin"}]
    assert expected == [
        {name: value for name, value in OmegaConf.to_container(spec).items()} for spec in specs
    ] + [environ]


def test_seed_values_of_the_example(example):
    """The example exports the seed's performance settings with their seed values."""
    written = export_env(example.delta, environ={}, tree={})
    expected = {
        "DTE_STREAMING_RECONSTRUCT": "1",
        "DTE_DELTA_P2P_COALESCE": "1",
        "DTE_INVERSION_ALLREDUCE_WINDOW_MB": "512",
        "DTE_INVERSION_COMPUTE_ON_CPU": "0",
    }
    assert expected == {name: written[name] for name in SEED_NAMES}


def test_export_into_objects_and_missing_env_vars():
    """Attribute-style specs (AReaL's dataclasses) and specs without env_vars are filled."""
    actor_spec = SimpleNamespace(env_vars=None)
    dataset_spec = {"cpu": 4}
    tree = SimpleNamespace(
        actor=SimpleNamespace(scheduling_spec=(actor_spec,)),
        train_dataset={"scheduling_spec": dataset_spec},
        rollout=SimpleNamespace(scheduling_spec=None),
    )
    written = export_env(DeltaConfig(), environ={}, tree=tree)
    expected = (written, written)
    assert expected == (actor_spec.env_vars, dataset_spec["env_vars"])


# (id, environment, full message)
READ_ERRORS = [
    (
        "bool-spelling",
        {"DTE_DELTA_P2P_COALESCE": "true"},
        "DTE_DELTA_P2P_COALESCE='true': expected 0 or 1; fix: set DTE_DELTA_P2P_COALESCE to 0 or 1",
    ),
    (
        "int-spelling",
        {"DTE_ANCHOR_INTERVAL": "20.0"},
        "DTE_ANCHOR_INTERVAL='20.0': expected a decimal integer; "
        "fix: set DTE_ANCHOR_INTERVAL to a decimal integer",
    ),
    (
        "negative",
        {"DTE_ANCHOR_INTERVAL": "-1"},
        "DTE_ANCHOR_INTERVAL='-1': must be >= 0; fix: write an integer >= 0",
    ),
    (
        "zero-window",
        {"DTE_INVERSION_ALLREDUCE_WINDOW_MB": "0"},
        "DTE_INVERSION_ALLREDUCE_WINDOW_MB='0': must be >= 1; fix: write an integer >= 1",
    ),
    (
        "method",
        {"DTE_DELTA_METHOD": "ADAMW"},
        "DTE_DELTA_METHOD='ADAMW': expected one of adamw | cast | snapshot; "
        "fix: write one of adamw | cast | snapshot",
    ),
    (
        "unknown",
        {"DTE_STREAMING_RECONSTRUCTION": "1"},
        "DTE_STREAMING_RECONSTRUCTION='1': unknown key; fix: remove it or write "
        "DTE_STREAMING_RECONSTRUCT",
    ),
]


@pytest.mark.parametrize(
    ("name", "environ", "message"), READ_ERRORS, ids=[e[0] for e in READ_ERRORS]
)
def test_read_rejects_with_message(name, environ, message):
    """A worker refuses variables it cannot parse, naming the variable."""
    with pytest.raises(ConfigValidationError) as caught:
        read_env(environ)
    assert message == str(caught.value)


def test_empty_environment_reads_defaults():
    """Without DTE_* variables a worker sees the defaults: the delta path off."""
    expected = DeltaConfig()
    assert expected == read_env({"HOME": "/root"})
