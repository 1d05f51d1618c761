"""The stack checks and installs of cluster mode, against AReaL 1.0.4's real modules."""

import importlib
import sys

import pytest
from areal_dte.areal import compat
from areal_dte.errors import IncompatibleStackError

pytestmark = pytest.mark.areal

TRAIN_WORKER = "areal.experimental.training_service.worker.awex"
SUFFIX = "cluster mode installs itself into these exact versions (packages/areal-dte/README.md)"


def test_the_areal_environment_is_the_pinned_trainer_stack():
    """AReaL 1.0.4, awex 0.7.0 and megatron-core 0.16.1 pass, and so do the worker's
    call-time import of its Megatron adapter and torch's group helper."""
    compat.check_trainer()


def test_a_version_outside_the_pin_names_both():
    """A pin the installed version is not in: the distribution, the pin and the version."""
    with pytest.raises(IncompatibleStackError) as caught:
        compat.check_pins([compat.Pin("awex", ("0.6.0", "0.6.1"))])
    assert f"awex version: expected 0.6.0 or 0.6.1, got 0.7.0; {SUFFIX}" == str(caught.value)


def test_the_rollout_stack_needs_sglang():
    """Without sglang (AReaL's CPU environment here) the rollout check stops at its pin."""
    with pytest.raises(IncompatibleStackError) as caught:
        compat.check_rollout()
    assert (f"sglang version: expected 0.5.10.post1, got not installed; {SUFFIX}"
            == str(caught.value))


def test_a_worker_that_no_longer_resolves_the_adapter_at_call_time_is_refused(monkeypatch):
    """If AReaL's worker stops importing its adapter when called, replacing the module
    attribute would change nothing: the check says so."""
    monkeypatch.setattr(importlib.import_module(TRAIN_WORKER), "_create_training_adapter",
                        lambda engine: engine)
    with pytest.raises(IncompatibleStackError) as caught:
        compat.check_trainer()
    assert str(caught.value).startswith(
        f"{TRAIN_WORKER}._create_training_adapter: expected an import of "
        f"{compat.MEGATRON_ADAPTER[0]}.AwexMegatronAdapter at call time, got [")


def test_install_puts_the_delta_adapter_where_the_worker_looks(monkeypatch):
    """After ``install`` the name AReaL's worker imports is the Delta adapter, a subclass
    of the one it replaced."""
    from areal_dte.areal import awex_megatron

    module = importlib.import_module(compat.MEGATRON_ADAPTER[0])
    original = module.AwexMegatronAdapter
    monkeypatch.setattr(module, "AwexMegatronAdapter", original)  # restored afterwards
    awex_megatron.install()
    assert (awex_megatron.DeltaAwexMegatronAdapter, True) == (
        module.AwexMegatronAdapter, issubclass(module.AwexMegatronAdapter, original))


@pytest.mark.parametrize("on", [False, True])
def test_the_sglang_extension_installs_only_with_the_path_on(on, monkeypatch):
    """Imported as SGLang's registry imports it: with the path off it leaves AReaL's
    adapter alone; with it on it checks the stack first (no sglang here: refused)."""
    module = importlib.import_module(compat.SGLANG_ADAPTER[0])
    original = module.AwexSGLangAdapter
    monkeypatch.setenv("DTE_ENABLE_DELTA_WEIGHT_UPDATE", "1" if on else "0")
    monkeypatch.delitem(sys.modules, "areal_dte.areal.sglang_ext.delta_adapter", raising=False)
    if on:
        with pytest.raises(IncompatibleStackError):
            importlib.import_module("areal_dte.areal.sglang_ext.delta_adapter")
    else:
        importlib.import_module("areal_dte.areal.sglang_ext.delta_adapter")
    assert original is module.AwexSGLangAdapter
