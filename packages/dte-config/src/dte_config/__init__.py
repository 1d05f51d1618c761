"""dte-config: what a user can set for the delta weight-update path, and what is rejected
before any GPU work starts.

Load an AReaL-style experiment YAML with `load_config`, check it with `validate`, hand the
settings to worker processes with `export_env` and rebuild them there with `read_env`.
"""

from dte_config.delta import DeltaConfig, DeltaMethod
from dte_config.env import export_env, read_env
from dte_config.errors import ConfigError, ConfigFileError, ConfigValidationError
from dte_config.load import load_config
from dte_config.rl import RLConfig
from dte_config.rules import validate
from dte_config.run import RunConfig

__all__ = [
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
]
