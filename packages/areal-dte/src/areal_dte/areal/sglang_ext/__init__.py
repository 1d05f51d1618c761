"""The package named in ``SGLANG_EXTERNAL_MODEL_PACKAGE`` for AReaL's rollout workers.

SGLang imports every module of this package in each process that loads a model, before
any RPC reaches its scheduler; `delta_adapter` installs the delta SGLang adapter there.
It defines no model class.

SGLang's registry logs an import error of such a module as a warning and goes on (as far
as read; not run against 0.5.10.post1), so a refused install (`IncompatibleStackError`)
leaves AReaL's own adapter in place: the trainers' first collective then finds no
partner and the update ends at the group's timeout, nothing written. Look for the
warning in the rollout's log.
"""
