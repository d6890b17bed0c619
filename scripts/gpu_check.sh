#!/usr/bin/env bash
# On a machine with a GPU and a CUDA build of torch: compile the ops with their CUDA sources, run the GPU
# tests against the pure-torch reference (tests/test_ops_cuda.py), and time decode attention on the GPU.
#
#   scripts/gpu_check.sh [tests|bench|all]   (default: all)
#
# Logs and figures go to $OUT (default ./gpu-check): build.log, tests.log, kernels.json, kernels.txt.
# Needs only what torch needs plus click, rich and pytest: the package is used from this checkout.
# If the build stops because the library "does not survive an op's argument error", the compiler in CXX links
# its own libstdc++; run with CXX=/usr/bin/g++ CC=/usr/bin/gcc (seen on an H100 image whose CXX was a
# relocated g++ under /opt/gcc).
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
out="${OUT:-gpu-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FP8KV_CACHE_DIR="${FP8KV_CACHE_DIR:-/tmp/fp8kv-gpu-check}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
fp8kv() { python3 -c "from launcher.cli import main; main()" "$@"; }
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee -a "$out/gpu.txt"

start=$SECONDS
if ! fp8kv build --verbose >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  echo "FAILED: build ($((SECONDS - start)) s)"
  exit 1
fi
echo "ok: build ($((SECONDS - start)) s)"

if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_ops_cuda.py >"$out/tests.log" 2>&1 || status=1
  grep -E "max error|FAILED|Error|passed|failed" "$out/tests.log" | tail -60
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  fp8kv bench kernels --device cuda --repeats 9 --json >"$out/kernels.json" 2>"$out/kernels.err" || status=1
  python3 - "$out/kernels.json" <<'PY' | tee "$out/kernels.txt"
import json, sys
rows = json.load(open(sys.argv[1]))
print(f"read bandwidth {rows[0]['read_bw_gbps']:.0f} GB/s")
print(f"{'impl':10} {'kv':13} {'dtype':9} {'batch':>5} {'ctx':>6} {'us':>9} {'KV GB/s':>8} {'% bw':>5}")
for r in rows:
    print(f"{r['impl']:10} {r['kv_cache_dtype']:13} {r['dtype']:9} {r['batch']:5} {r['context']:6} "
          f"{1000 * r['ms']:9.1f} {r['kv_gbps']:8.0f} {100 * r['kv_gbps'] / r['read_bw_gbps']:5.0f}")
PY
fi
exit $status
