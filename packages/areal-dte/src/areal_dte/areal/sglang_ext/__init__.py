"""The package named in ``SGLANG_EXTERNAL_MODEL_PACKAGE`` for AReaL's rollout workers.

SGLang imports every module of this package in each process that loads a model, before
any RPC reaches its scheduler; `delta_adapter` installs the delta SGLang adapter there.
It defines no model class.
"""
