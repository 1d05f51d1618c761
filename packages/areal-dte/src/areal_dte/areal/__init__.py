"""The AReaL 1.0.4 cluster mode: AReaL's own trainer, workers and weight-update path,
with the delta path installed where AReaL and SGLang let code in.

Modules are imported by name (``areal_dte.areal.areal_job``, ...), never here: each one
imports AReaL, and some its Megatron stack, which only the cluster image holds.
"""
