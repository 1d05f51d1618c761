"""The stack checks and installs of cluster mode, against AReaL 1.0.4's real modules."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

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


def _with_sglang(code: str, folder, **env: str) -> None:
    """Run ``code`` in a process of its own that can import SGLang's scheduler: without a
    GPU, that needs ``sglang_cpu``'s no-device driver, loaded first."""
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", "import sys, sglang_cpu; "
         f"sglang_cpu.load_no_device_driver(sys.argv[1]); {code}", str(folder)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path, **env})
    assert 0 == done.returncode, done.stderr[-3000:]


def test_the_areal_environment_is_the_pinned_rollout_stack(tmp_path):
    """AReaL's SGLang (0.5.10.post1) passes, and so do the scheduler bridge's call-time
    import of its SGLang adapter and the Scheduler's ``flush_cache``."""
    _with_sglang("from areal_dte.areal import compat; compat.check_rollout()", tmp_path)


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


def test_the_sglang_extension_leaves_areal_alone_with_the_path_off(monkeypatch):
    """Imported as SGLang's registry imports it, with the path off: AReaL's adapter stays."""
    module = importlib.import_module(compat.SGLANG_ADAPTER[0])
    original = module.AwexSGLangAdapter
    monkeypatch.setenv("DTE_ENABLE_DELTA_WEIGHT_UPDATE", "0")
    monkeypatch.delitem(sys.modules, "areal_dte.areal.sglang_ext.delta_adapter", raising=False)
    importlib.import_module("areal_dte.areal.sglang_ext.delta_adapter")
    assert original is module.AwexSGLangAdapter


def test_the_sglang_extension_installs_the_delta_adapter_with_the_path_on(tmp_path):
    """With the path on, the import checks the stack (AReaL's SGLang passes) and puts
    the Delta adapter where AReaL's scheduler bridge looks its adapter up."""
    _with_sglang(
        "import importlib; from areal_dte.areal import compat; "
        "module = importlib.import_module(compat.SGLANG_ADAPTER[0]); "
        "importlib.import_module('areal_dte.areal.sglang_ext.delta_adapter'); "
        "from areal_dte.areal.awex_sglang import DeltaAwexSGLangAdapter; "
        "assert module.AwexSGLangAdapter is DeltaAwexSGLangAdapter, module.AwexSGLangAdapter",
        tmp_path, DTE_ENABLE_DELTA_WEIGHT_UPDATE="1")
