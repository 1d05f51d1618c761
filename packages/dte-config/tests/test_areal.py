"""With the areal extra: the same checks accept AReaL's own config objects.

Run: see the package README (a separate environment, since AReaL pins its own torch).
"""

from __future__ import annotations

import attrs
import pytest
from dte_config import ConfigValidationError, RLConfig, RunConfig, export_env, load_config, validate

pytestmark = pytest.mark.areal


@pytest.fixture(scope="module")
def cli_args():
    """AReaL's config module, or a skip when the areal extra is not installed."""
    return pytest.importorskip(
        "areal.api.cli_args", reason="needs the areal extra (see the package README)"
    )


@pytest.fixture(scope="module")
def areal_example(cli_args, example_path):
    """The reference example as AReaL's own GRPOConfig, built by AReaL's loader."""
    from omegaconf import OmegaConf

    loaded = load_config(example_path, [])
    structured = cli_args.to_structured_cfg(loaded.without_delta_keys(), cli_args.GRPOConfig)
    return loaded, OmegaConf.to_object(structured)


def test_areal_accepts_the_example_without_delta_keys(cli_args, areal_example):
    """AReaL's loader builds its GRPOConfig and PPOActorConfig from the trimmed example."""
    _, config = areal_example
    expected = (cli_args.GRPOConfig, cli_args.PPOActorConfig)
    assert expected == (type(config), type(config.actor))


def test_areal_objects_read_like_the_yaml(areal_example):
    """RLConfig read from AReaL's objects equals the one read from the YAML tree."""
    loaded, config = areal_example
    assert loaded.config.rl == RLConfig.read(config)


def test_validate_accepts_areal_experiment_config(areal_example):
    """The reference example validates as AReaL's GRPOConfig."""
    loaded, config = areal_example
    expected = None
    assert expected == validate(RunConfig(delta=loaded.config.delta, rl=RLConfig.read(config)))


def test_validate_rejects_areal_actor_with_two_minibatches(cli_args, areal_example, example_path):
    """A real PPOActorConfig with ppo_n_minibatches=2 is rejected with the YAML's message."""
    loaded, config = areal_example
    actor = cli_args.PPOActorConfig(
        backend=config.actor.backend,
        ppo_n_minibatches=2,
        optimizer=cli_args.OptimizerConfig(type="adam", lr=3e-6, weight_decay=0.003),
        scheduling_spec=config.actor.scheduling_spec,
    )
    areal_config = cli_args.GRPOConfig(actor=actor, rollout=config.rollout)
    with pytest.raises(ConfigValidationError) as caught:
        validate(RunConfig(delta=loaded.config.delta, rl=RLConfig.read(areal_config)))
    with pytest.raises(ConfigValidationError) as from_yaml:
        validate(load_config(example_path, ["actor.ppo_n_minibatches=2"]).config)
    assert str(from_yaml.value) == str(caught.value)


def test_areal_defaults_are_mirrored(cli_args):
    """RLConfig's defaults are AReaL 1.0.4's for an experiment that sets nothing."""
    defaults = RLConfig.read(cli_args.GRPOConfig())
    missing = "???"  # AReaL requires both backends; OmegaConf's mark for a missing value
    expected = attrs.evolve(RLConfig(), actor_backend=missing, rollout_backend=missing)
    assert expected == defaults


def test_export_into_areal_scheduling_specs(areal_example):
    """export_env writes the variables into AReaL's SchedulingSpec objects."""
    loaded, config = areal_example
    written = export_env(loaded.config.delta, environ={}, tree=config)
    expected = [written, written]
    assert expected == [
        {name: value for name, value in spec.env_vars.items() if name.startswith("DTE_")}
        for spec in (config.actor.scheduling_spec[0], config.rollout.scheduling_spec[0])
    ]
