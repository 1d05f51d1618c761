#!/usr/bin/env bash
# Every GPU check of the repository in one device call, repository root, results in $OUT:
# the kernel tests against their torch references (bitwise), the detection kernels against
# the copy bandwidth, the end-to-end sync benchmark with both detectors (the adamw run
# profiled), megatron-core's own optimizer with both detectors (megatron-core 0.16.1's cp312
# wheel in .whl/, with omegaconf, antlr4, hypothesis and sortedcontainers) and the cast's
# floor (tools/gpu/cast_floor.py); see docs/benchmarks.md for the commands' history.
#   OUT=/tmp/out SHA=$(git rev-parse --short HEAD) bash tools/gpu/check_all.sh
set -uo pipefail
: "${OUT:?}" "${SHA:?}"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:packages/dte-detector/src:packages/dte-codec/src:packages/dte-transport/src:packages/dte-config/src:packages/areal-dte/src:tools
mkdir -p "$OUT"
status=0
python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
  packages/dte-detector/tests/test_kernels.py packages/dte-codec/tests/test_kernels.py \
  packages/dte-codec/tests/test_decode_kernels.py packages/dte-codec/tests/test_kernel_bits.py \
  packages/dte-codec/tests/test_body_digest.py packages/dte-codec/tests/test_box_copy.py \
  packages/dte-codec/tests/test_encode_plan.py packages/dte-codec/tests/test_flat.py \
  packages/dte-codec/tests/test_decode.py packages/dte-codec/tests/test_entry_table.py \
  packages/dte-codec/tests/test_warmup.py packages/dte-codec/tests/test_tensor_set.py \
  packages/areal-dte/tests/test_shard_stage_routes.py packages/areal-dte/tests/test_torch_actor.py \
  packages/areal-dte/tests/test_shard_stage_copies.py \
  packages/areal-dte/tests/test_shard_stage_queued.py \
  packages/dte-codec/tests/test_table_skeleton.py tests/test_flat_changes.py > "$OUT/gpu_tests.log" 2>&1 || status=1
tail -3 "$OUT/gpu_tests.log"
python3 tools/gpu/bench_kernels.py --numel --model qwen3-4b --modes batched --reps 5 \
  --warmup 2 --reference-reps 1 --sha "$SHA" --out "$OUT/kernels.json" 2>&1 | grep "^|" || status=1
python3 tools/bench_sync.py --steps 10 --warmup-steps 2 --profile --sha "$SHA" \
  --out "$OUT/adamw" 2>&1 | grep "^|" || status=1
python3 tools/gpu/check_megatron.py --syncs "${MEGATRON_SYNCS:-10}" --out "$OUT/megatron.json" \
  > "$OUT/megatron.log" 2>&1 || status=1
tail -4 "$OUT/megatron.log"
python3 tools/bench_sync.py --method cast --steps 10 --warmup-steps 2 --sha "$SHA" \
  --out "$OUT/cast" 2>&1 | grep "^|" || status=1
python3 tools/gpu/cast_floor.py --sha "$SHA" 2>&1 | tee "$OUT/floor.md" | grep "^|" || status=1
exit $status
