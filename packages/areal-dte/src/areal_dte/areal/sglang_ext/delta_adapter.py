"""Installs `awex_sglang.DeltaAwexSGLangAdapter` when SGLang's registry imports this module,
if the worker's ``DTE_*`` variables switch the delta path on (AReaL's own adapter, and
nothing of areal-dte's, otherwise)."""

import os

from dte_config import read_env

if read_env(os.environ).enable_delta_weight_update:
    from ..awex_sglang import install

    install()
