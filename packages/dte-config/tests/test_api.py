"""The public API of dte_config is exactly the documented set of names."""

import dte_config


def test_all_is_pinned():
    """__all__ lists exactly the public names the README documents."""
    expected = {
        "ConfigError",
        "ConfigFileError",
        "ConfigValidationError",
        "DeltaConfig",
        "DeltaMethod",
        "RLConfig",
        "RunConfig",
        "export_env",
        "load_config",
        "read_env",
        "validate",
    }
    assert expected == set(dte_config.__all__)


def test_every_public_name_resolves():
    """Every name in __all__ is an attribute of the package."""
    expected = []
    assert expected == [name for name in dte_config.__all__ if not hasattr(dte_config, name)]


def test_errors_subclass_their_builtins():
    """Leaves subclass the root and the matching builtin, so callers may catch either."""
    expected = (True, True, True, True)
    assert expected == (
        issubclass(dte_config.ConfigValidationError, dte_config.ConfigError),
        issubclass(dte_config.ConfigValidationError, ValueError),
        issubclass(dte_config.ConfigFileError, dte_config.ConfigError),
        issubclass(dte_config.ConfigFileError, FileNotFoundError),
    )
