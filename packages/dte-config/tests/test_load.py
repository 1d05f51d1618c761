"""load_config: composition, dotted overrides, unknown keys and wrong types, file errors."""

from __future__ import annotations

import attrs
import pytest
from dte_config import (
    ConfigFileError,
    ConfigValidationError,
    DeltaConfig,
    DeltaMethod,
    RLConfig,
    load_config,
    validate,
)
from omegaconf import OmegaConf


def test_example_loads_the_seed_settings(example_path):
    """The reference example yields the seed's delta settings and RL run."""
    loaded = load_config(example_path, [])
    expected = (
        DeltaConfig(enable_delta_weight_update=True),
        "megatron:(attn:d2p1t4|ffn:d1p1e8)",
        "sglang:d2t4p1",
        1,
        3e-6,
        0.003,
        2,
    )
    assert expected == (
        loaded.config.delta,
        loaded.config.rl.actor_backend,
        loaded.config.rl.rollout_backend,
        loaded.config.rl.ppo_n_minibatches,
        loaded.tree.actor.optimizer.lr,
        loaded.tree.actor.optimizer.weight_decay,
        loaded.tree.cluster.n_nodes,
    )


def test_overrides_reach_nested_keys_and_list_entries(example_path):
    """Dotted overrides set mappings and list entries; interpolations follow them."""
    loaded = load_config(
        example_path,
        [
            "scheduler.type=slurm",
            "actor.scheduling_spec.0.image=/images/areal.sif",
            "actor.ppo_n_minibatches=2",
            "actor.weight_update_delta_method=cast",
        ],
    )
    expected = ("slurm", "/images/areal.sif", "/images/areal.sif", 2, DeltaMethod.CAST)
    assert expected == (
        loaded.tree.scheduler.type,
        loaded.tree.actor.scheduling_spec[0].image,
        loaded.tree.rollout.scheduling_spec[0].image,
        loaded.config.rl.ppo_n_minibatches,
        loaded.config.delta.weight_update_delta_method,
    )


def test_defaults_compose_files_and_self(composed_path, example_path):
    """A ``defaults:`` list merges the named file first, then the including file's keys."""
    composed = load_config(composed_path, [])
    base = load_config(example_path, [])
    expected = ("cast0", "cast0", 4, DeltaMethod.CAST, base.config.rl.actor_backend)
    assert expected == (
        composed.tree.trial_name,
        composed.tree.rollout.trial_name,
        composed.config.rl.ppo_n_minibatches,
        composed.config.delta.weight_update_delta_method,
        composed.config.rl.actor_backend,
    )


def test_no_file_gives_defaults():
    """Without a file and overrides every setting keeps its default."""
    loaded = load_config(None, [])
    expected = (DeltaConfig(), RLConfig(), {})
    assert expected == (loaded.config.delta, loaded.config.rl, OmegaConf.to_container(loaded.tree))


def test_disabling_changes_nothing_else(example_path):
    """enable_delta_weight_update=false leaves the RL settings and AReaL's tree untouched."""
    on = load_config(example_path, [])
    off = load_config(example_path, ["actor.enable_delta_weight_update=false"])
    expected = (
        on.config.rl,
        OmegaConf.to_container(on.without_delta_keys()),
        attrs.evolve(on.config.delta, enable_delta_weight_update=False),
    )
    assert expected == (
        off.config.rl,
        OmegaConf.to_container(off.without_delta_keys()),
        off.config.delta,
    )


def test_without_delta_keys_leaves_only_areal_keys(example_path):
    """The trimmed tree has no delta key under actor and keeps every other key."""
    loaded = load_config(example_path, [])
    actor = OmegaConf.to_container(loaded.without_delta_keys())["actor"]
    expected = ([], loaded.tree.actor.backend)
    assert expected == (
        [name for name in attrs.fields_dict(DeltaConfig) if name in actor],
        actor["backend"],
    )


def test_caller_sections_are_composed_and_kept_out_of_the_checks(tmp_path, example_path):
    """A root section named in sections= takes overrides, comes back resolved, is not
    checked against AReaL's keys, and leaves the trimmed tree; unnamed it is rejected."""
    path = tmp_path / "app.yaml"
    path.write_text(f"defaults:\n  - {example_path}\n  - _self_\napp:\n  width: 8\n"
                    "  seed: ${seed}\n")
    loaded = load_config(path, ["app.width=16"], sections=["app"])
    expected = ({"app": {"width": 16, "seed": loaded.tree.seed}}, False, loaded.config)
    assert expected == (
        loaded.sections,
        "app" in loaded.without_delta_keys(),
        load_config(example_path, []).config,
    )
    with pytest.raises(ConfigValidationError) as caught:
        load_config(path, [])
    assert "app" == caught.value.key


# (id, overrides, full message)
LOAD_ERRORS = [
    (
        "unknown-actor-key",
        ["actor.ppo_n_minibatch=1"],
        "actor.ppo_n_minibatch=1: unknown key; fix: remove it or write actor.ppo_n_minibatches",
    ),
    (
        "unknown-top-key",
        ["rollouts.backend=sglang:d1"],
        "rollouts={'backend': 'sglang:d1'}: unknown key; fix: remove it or write rollout",
    ),
    (
        "unknown-delta-key",
        ["actor.weight_update_delta_performance.p2p_coalesc=true"],
        "actor.weight_update_delta_performance.p2p_coalesc=true: unknown key; fix: remove it "
        "or write actor.weight_update_delta_performance.p2p_coalesce",
    ),
    (
        "unknown-spec-key",
        ["actor.scheduling_spec.0.imag=x"],
        # rollout.scheduling_spec interpolates the actor's and comes first in the file
        "rollout.scheduling_spec.0.imag='x': unknown key; fix: remove it or write "
        "rollout.scheduling_spec.0.image",
    ),
    (
        "string-for-int",
        ["actor.ppo_n_minibatches='1'"],
        "actor.ppo_n_minibatches='1': expected an integer, got str; fix: write an integer",
    ),
    (
        "bool-for-int",
        ["actor.ppo_n_minibatches=true"],
        "actor.ppo_n_minibatches=true: expected an integer, got bool; fix: write an integer",
    ),
    (
        "int-for-bool",
        ["actor.use_lora=1"],
        "actor.use_lora=1: expected true or false, got int; fix: write true or false",
    ),
    (
        "null-for-required",
        ["actor.backend=null"],
        "actor.backend=null: expected a string, got NoneType; fix: write a string "
        "(quote it if it looks like a number)",
    ),
    (
        "int-env-var",
        ["actor.scheduling_spec.0.env_vars.DTE_DELTA_P2P_COALESCE=1"],
        "rollout.scheduling_spec.0.env_vars.DTE_DELTA_P2P_COALESCE=1: expected a string, got "
        "int; fix: write a string (quote it if it looks like a number)",
    ),
    (
        "bad-delta-method",
        ["actor.weight_update_delta_method=adam"],
        "actor.weight_update_delta_method='adam': expected one of adamw | cast | snapshot; "
        "fix: write one of adamw | cast | snapshot",
    ),
    (
        "negative-anchor",
        ["actor.weight_update_anchor_interval=-1"],
        "actor.weight_update_anchor_interval=-1: must be >= 0; fix: write an integer >= 0",
    ),
    (
        "zero-window",
        ["actor.weight_update_delta_performance.inversion_allreduce_window_mb=0"],
        "actor.weight_update_delta_performance.inversion_allreduce_window_mb=0: must be >= 1; "
        "fix: write an integer >= 1",
    ),
    (
        "delta-group-not-mapping",
        ["actor.weight_update_delta_diagnostics=true"],
        "actor.weight_update_delta_diagnostics=true: expected a mapping of DiagnosticsConfig "
        "keys, got bool; fix: write actor.weight_update_delta_diagnostics as a mapping",
    ),
    (
        "malformed-override",
        ["actor.ppo_n_minibatches"],
        "actor.ppo_n_minibatches='actor.ppo_n_minibatches': malformed override; "
        "fix: write dotted.key=value",
    ),
    (
        "list-index-out-of-range",
        ["actor.scheduling_spec.3.image=x"],
        "actor.scheduling_spec.3.image='x': list index out of range; "
        "fix: address an existing list entry by index, or a mapping key",
    ),
    (
        "dangling-interpolation",
        ["gconfig.top_p=${nowhere.path}"],
        "gconfig.top_p=\"Interpolation key 'nowhere.path' not found\": interpolation does not "
        "resolve; fix: define the referenced key or write the value",
    ),
]


@pytest.mark.parametrize(
    ("name", "overrides", "message"), LOAD_ERRORS, ids=[e[0] for e in LOAD_ERRORS]
)
def test_load_rejects_with_message(example_path, name, overrides, message):
    """Unknown keys, wrong types and malformed overrides are errors, never warnings."""
    with pytest.raises(ConfigValidationError) as caught:
        load_config(example_path, overrides)
    assert message == str(caught.value)


# (id, overrides) that load but that validate rejects, naming the overridden key
VALIDATE_ERRORS = [
    (
        "colocation",
        ["rollout.scheduling_strategy.type=colocation"],
        "rollout.scheduling_strategy.type",
    ),
    ("fsdp", ["actor.backend=fsdp:d4"], "actor.backend"),
    ("vllm", ["rollout.backend=vllm:d4"], "rollout.backend"),
    ("lora", ["actor.use_lora=true"], "actor.use_lora"),
    ("minibatches", ["actor.ppo_n_minibatches=2"], "actor.ppo_n_minibatches"),
    ("no-optimizer", ["actor.optimizer=null"], "actor.optimizer"),
    (
        "overlap",
        ["actor.megatron.ddp.overlap_param_gather=true"],
        "actor.megatron.ddp.overlap_param_gather",
    ),
    ("offload", ["enable_offload=true"], "enable_offload"),
    (
        "spec-env",
        ["actor.scheduling_spec.0.env_vars.DTE_DELTA_P2P_COALESCE='0'"],
        "rollout.scheduling_spec.0.env_vars.DTE_DELTA_P2P_COALESCE",
    ),
]


@pytest.mark.parametrize(
    ("name", "overrides", "key"), VALIDATE_ERRORS, ids=[e[0] for e in VALIDATE_ERRORS]
)
def test_yaml_keys_reach_the_checks(example_path, name, overrides, key):
    """An override of a checked AReaL key makes validate reject with that key."""
    with pytest.raises(ConfigValidationError) as caught:
        validate(load_config(example_path, overrides).config)
    assert key == caught.value.key


def test_missing_file(tmp_path):
    """A config file that does not exist raises ConfigFileError naming it."""
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigFileError) as caught:
        load_config(path, [])
    assert f"config file {path} not found (named by the caller)" == str(caught.value)


def test_missing_default_names_the_including_file(tmp_path):
    """A ``defaults:`` entry that names no file is reported with the file naming it."""
    main = tmp_path / "main.yaml"
    main.write_text("defaults:\n  - base\n")
    with pytest.raises(ConfigFileError) as caught:
        load_config(main, [])
    assert f"config file {tmp_path / 'base.yaml'} not found (named by {main})" == str(caught.value)


def test_defaults_cycle(tmp_path):
    """Files that include each other are rejected."""
    (tmp_path / "a.yaml").write_text("defaults:\n  - b\n")
    (tmp_path / "b.yaml").write_text("defaults:\n  - a@_global_\n")
    with pytest.raises(ConfigValidationError) as caught:
        load_config(tmp_path / "a.yaml", [])
    expected = (
        f"{tmp_path / 'b.yaml'}: defaults='{tmp_path / 'a.yaml'}': defaults form a cycle; "
        "fix: remove one of the entries that include each other"
    )
    assert expected == str(caught.value)


def test_defaults_other_package(tmp_path):
    """Only entries merged at the root are supported."""
    main = tmp_path / "main.yaml"
    main.write_text("defaults:\n  - base@actor\n")
    with pytest.raises(ConfigValidationError) as caught:
        load_config(main, [])
    expected = (
        f"{main}: defaults.0='base@actor': only file entries merged at the root are "
        "supported; fix: write a file name relative to this file, optionally with @_global_"
    )
    assert expected == str(caught.value)


def test_self_position_decides_precedence(tmp_path):
    """Keys of the including file lose to defaults listed after ``_self_``."""
    (tmp_path / "base.yaml").write_text("seed: 1\n")
    main = tmp_path / "main.yaml"
    main.write_text("defaults:\n  - _self_\n  - base\nseed: 2\n")
    expected = 1
    assert expected == load_config(main, []).tree.seed


def test_malformed_yaml(tmp_path):
    """A YAML syntax error is a ConfigValidationError naming the file."""
    path = tmp_path / "bad.yaml"
    path.write_text("actor: [\n")
    with pytest.raises(ConfigValidationError) as caught:
        load_config(path, [])
    expected = (str(path), "malformed YAML")
    assert expected == (caught.value.key, caught.value.problem)


def test_top_level_list(tmp_path):
    """A YAML file whose top is a list is rejected."""
    path = tmp_path / "list.yaml"
    path.write_text("- a\n")
    with pytest.raises(ConfigValidationError) as caught:
        load_config(path, [])
    expected = (
        f"{path}='ListConfig': expected a mapping at the top; "
        "fix: write the config as a mapping of keys"
    )
    assert expected == str(caught.value)
