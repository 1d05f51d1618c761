"""Static SASS of the detection kernels' tile loops, compiled for sm_90 without a GPU.

Compiles ``inversion_kernel._mark`` and ``cast_kernel._record`` (bf16 payload, aligned
groups, the default tile of ``[128, 8]`` and 4 warps, so 8 elements per thread and loop
iteration) through Triton's CUDA backend and ``ptxas``, disassembles them with the
``cuobjdump`` that Triton bundles, and prints per kernel: registers, the instructions of
the tile loop (the longest backward branch), and those left without the regions that
forward branches skip around a ``CALL`` (the IEEE ``sqrt``/``/`` fix-ups for special
operands, and the inversion's per-tile ``mu`` block, which a tile runs only when one of
its elements needs it): an estimate of the common path, not a count of executed
instructions. Static counts, not timings: the GPU benchmark is ``tools/gpu/bench_kernels.py``.

Run (any machine with ``triton``; ``--src`` picks the detector sources to compile, e.g. a
checkout of an older commit, for before/after counts):
    uv run python tools/kernel_sass.py [--src packages/dte-detector/src]
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ARCH = 90
ROWS = 128
WARPS = 4
_SCALARS = {"inv_sqrt_bc2", "eps", "step_size", "inv_decay", "relative", "bias", "floor",
            "underflow", "half_eta"}
_POINTERS = {"p_ptr": "*fp32", "m_ptr": "*fp32", "v_ptr": "*fp32", "master_ptr": "*fp32",
             "model_ptr": "*i16", "dirty_ptr": "*u8"}
"""Pointer types as the launches pass them; the rest are int64 tables, counts and slabs,
except the cast's int32 slab (also passed as its unused output pointers)."""
_CAST_SLAB = {"slab_ptr": "*i32", "index_ptr": "*i32", "old_ptr": "*i32"}
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"(@!?U?P\w+\s+)?BRA\s+(?:`\(\.L_x_\d+\)|0x)?([0-9a-f]+)")


def _compile(fn, constants: dict, pointers: dict, registers: int | None) -> tuple[str, int]:
    """SASS text and registers of ``fn`` for sm_``ARCH`` (at most ``registers``, the
    module's ``REGISTERS`` cap, if set)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {name: "constexpr" if name in constants
                 else "fp32" if name in _SCALARS
                 else pointers.get(name, "*i64") if name.endswith("_ptr") else "i64"
                 for name in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values())
             if kind.startswith("*")}
    source = ASTSource(fn=fn, signature=signature, attrs=attrs,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", ARCH, 32),
                            options={"num_warps": WARPS, "enable_fp_fusion": False,
                                     "maxnreg": registers})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as cubin:
        cubin.write(kernel.asm["cubin"])
    try:
        sass, usage = (subprocess.run([tool, flag, cubin.name], capture_output=True, text=True,
                                      check=True).stdout for flag in ("-sass", "-res-usage"))
    finally:
        os.unlink(cubin.name)
    return sass, int(re.search(r"REG:(\d+)", usage).group(1))


def loop_counts(sass: str) -> tuple[int, int]:
    """Instructions of the longest loop, and of it without the regions that forward
    branches skip around a ``CALL``."""
    code = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass.splitlines())
            if m]
    span, low, high = 0, 0, -1
    for at, text in code:
        branch = _BRANCH.match(text)
        if branch and at - int(branch.group(2), 16) > span:
            span, low, high = at - int(branch.group(2), 16), int(branch.group(2), 16), at
    loop = [(at, text) for at, text in code if low <= at <= high]
    skipped: set[int] = set()
    for at, text in loop:
        branch = _BRANCH.match(text)
        if branch and branch.group(1) and int(branch.group(2), 16) > at:
            region = [(a, t) for a, t in loop if at < a < int(branch.group(2), 16)]
            if any("CALL" in t for _, t in region):
                skipped.update(a for a, _ in region)
    return len(loop), len(loop) - len(skipped)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1]
                                             / "packages" / "dte-detector" / "src"))
    args = parser.parse_args()
    sys.path.insert(0, args.src)
    import triton.language as tl
    inversion = importlib.import_module("dte_detector.inversion_kernel")
    cast = importlib.import_module("dte_detector.cast_kernel")
    kernels = [("inversion _mark", inversion, inversion._mark, _POINTERS,
                {"DECAY_IS_ONE": False, "PAYLOAD": tl.bfloat16, "ROWS": ROWS,
                 "SLAB": ROWS * 8 // inversion.SLAB_FRACTION, "ALIGN": 4, "NARROW": True}),
               ("cast _record", cast, cast._record, {**_POINTERS, **_CAST_SLAB},
                {"PAYLOAD": tl.bfloat16, "NAN_ABOVE": 0x7F80, "COPY": True, "ROWS": ROWS,
                 "SLAB": ROWS * 8 // cast.SLAB_FRACTION, "FP32_ALIGN": 4, "HALF_ALIGN": 8,
                 "NARROW": True})]
    print("| kernel | registers | loop instructions (8 elements/thread) | without slow paths |")
    print("|---|---|---|---|")
    for name, module, fn, pointers, constants in kernels:
        constants = {k: v for k, v in constants.items() if k in fn.arg_names}
        sass, registers = _compile(fn, constants, pointers, getattr(module, "REGISTERS", None))
        total, common = loop_counts(sass)
        print(f"| {name} | {registers} | {total} | {common} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
