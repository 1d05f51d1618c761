"""SGLang 0.5.10.post1 (AReaL 1.0.4's, in .venv-areal) on CPU: its process state and its
Qwen3 model classes, for the awex cluster tests' rollout ranks.

What it takes, and why (``sglang_world`` does the same for 0.5.23 in the default
environment):

- ``SGLANG_USE_CPU_ENGINE=1``: SGLang's own switch to its CPU engine (``is_cpu()``).
- A CUDA driver with no device: SGLang imports ``sgl_kernel`` at import time (its host
  KV-cache module), and the PyPI ``sglang-kernel`` wheel links ``libcuda.so.1``, which a
  machine without an NVIDIA driver lacks. There `load_no_device_driver` builds and loads
  a library of that name whose every entry point answers ``CUDA_ERROR_NO_DEVICE``, as a
  driver on a machine without a GPU does; nothing here calls it (torch reports no CUDA).
- Its distributed state over gloo, and its data-parallel-attention state, as its model
  runner sets them up before it builds a model.

sglang is imported inside the functions: this module is collected in the default run too.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import types

import torch

NO_DEVICE = 100
"""``CUDA_ERROR_NO_DEVICE``."""
_DRIVER_ENTRY_POINTS = (
    "cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuGetProcAddress",
    "cuGetProcAddress_v2", "cuGetErrorString", "cuMemAddressFree", "cuMemGetAddressRange_v2",
    "cuMemRelease", "cuMemRetainAllocationHandle", "cuMemSetAccess", "cuMemUnmap",
    "cuPointerGetAttribute",
)
"""What ``sgl_kernel``'s libraries import from the driver, and what the CUDA runtime
asks first when torch probes for a device."""


def load_no_device_driver(folder: str) -> None:
    """Unless the machine has a CUDA driver, build ``libcuda.so.1`` answering `NO_DEVICE`
    everywhere into ``folder`` and load it globally, so that libraries linked against the
    driver find it by its soname.

    Raises:
        RuntimeError: no C compiler on this machine.
    """
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        return  # a real driver: never shadow it
    except OSError:
        pass
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc) to build the no-device libcuda.so.1 "
                           "that sglang-kernel's import needs on a machine without a GPU")
    # per process: the ranks of one test build theirs side by side
    stem = os.path.join(folder, f"no-device-driver-{os.getpid()}")
    source, library = f"{stem}.c", f"{stem}.so"
    with open(source, "w") as fh:
        fh.write("".join(f"int {name}(void) {{ return {NO_DEVICE}; }}\n"
                         for name in _DRIVER_ENTRY_POINTS))
    subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", library,
                    source], check=True)
    ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)


def start(folder: str, init_method: str, *, tp: int, rank: int):
    """Set up this process as SGLang TP rank ``rank`` of ``tp`` on CPU, over gloo
    (rendezvous at ``init_method``); returns SGLang's ``ServerArgs`` of the rank."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    # torch here is a CUDA build without a GPU: the TP group must not open the NCCL it
    # ships (SGLang skips pynccl when the library does not load, as on a CPU-only torch)
    os.environ["SGLANG_NCCL_SO_PATH"] = os.path.join(folder, "no-nccl-on-cpu.so")
    load_no_device_driver(folder)
    from sglang.srt.distributed import parallel_state
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    # "dummy": SGLang's own no-checkpoint mode, which resolves no model files or hub names
    server_args = ServerArgs(model_path="dummy", device="cpu", tp_size=tp)
    set_global_server_args_for_scheduler(server_args)
    parallel_state.init_distributed_environment(
        world_size=tp, rank=rank, local_rank=rank, backend="gloo",
        distributed_init_method=init_method)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, backend="gloo")
    return server_args


def sglang_model(server_args, hf_config) -> torch.nn.Module:
    """SGLang's Qwen3ForCausalLM or Qwen3MoeForCausalLM of ``hf_config``, bf16, unloaded."""
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    # the two fields of SGLang's ModelConfig that this reads (the rest need a checkpoint)
    initialize_dp_attention(server_args, types.SimpleNamespace(
        hidden_size=hf_config.hidden_size, dtype=torch.bfloat16))
    model_class = Qwen3MoeForCausalLM if getattr(hf_config, "num_experts", 0) else (
        Qwen3ForCausalLM)
    with set_default_torch_dtype(torch.bfloat16):
        return model_class(hf_config)
