#!/usr/bin/env bash
# Compile checks of the GPU code on machines without a GPU: everything is compiled, nothing is run.
#
#   scripts/compile_check.sh [cuda|cuda-kernels|cuda-bindings|hip|hip-kernels|hip-hipify|all]  (default: all)
#
#   cuda-kernels   nvcc: csrc/cuda/kernels_*.cu and hadamard_kernels.cu (torch-free, all kernels) for
#                  each of CUDA_ARCHS (default "80 90"; "80 89 90" adds sm_89, which compiles the same branches
#                  as sm_90: the sources only ask for >= 800 and >= 890). The last one is compiled as a release
#                  build (-O3, spills are errors, ptxas's report of the tensor-core kernels' registers and shared
#                  memory), the others unoptimized (CUDA_OPTIMIZE_ALL=1 optimizes them too)
#   cuda-bindings  nvcc -std=c++20: csrc/cuda/torch_bindings_cuda.cu and hadamard.cu (one translation unit) for
#                  sm_90, against the headers of a CUDA build of torch unzipped from a wheel (this machine's torch
#                  is CPU-only)
#   cuda           both of the above
#   hip-kernels    hipcc (HIP_PLATFORM=amd): the same kernel files as HIP (-x hip), all as one translation
#                  unit: code for gfx90a (unoptimized; HIP_OPTIMIZE=1: -O3), analysed (-fsyntax-only) for gfx940
#   hip-hipify     torch.utils.hipify on a copy of csrc/ (as a ROCm torch build does), then hipcc -fsyntax-only
#                  on the hipified kernel files (one translation unit) for gfx90a (both sides analysed;
#                  hip-kernels generates the code)
#   hip            both HIP checks. The bindings are not HIP-compiled: there are no ROCm torch headers here.
#
# Exit status: 0 compiled, 1 a compile failed, 77 skipped because a compiler (or the torch wheel) is missing.
# Environment: NVCC, HIPCC (compilers), PYTHON (with torch, for hipify), TORCH_CUDA_WHEEL (a CUDA torch
# wheel), FP8KV_CACHE_DIR, CUDA_ARCHS, CUDA_OPTIMIZE_ALL and HIP_OPTIMIZE (above),
# FP8KV_COMPILE_CHECK_CACHE=0 (compile even when these inputs passed before: see run_cached).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CSRC="$ROOT/csrc"
CACHE_DIR="${FP8KV_CACHE_DIR:-$HOME/.cache/fp8kv}"
TORCH_CUDA_WHEEL="${TORCH_CUDA_WHEEL:-/opt/pypi-more/files/torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl}"
SKIPPED=77

# What torch.utils.cpp_extension passes to nvcc, so the kernels compile here as they do in a real build.
TORCH_NVCC_FLAGS=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
                  -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr)
# ... and to hipcc for ROCm builds.
TORCH_HIPCC_FLAGS=(-DUSE_ROCM=1 -D__HIP_NO_HALF_OPERATORS__=1 -D__HIP_NO_HALF_CONVERSIONS__=1)

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
# The compilers' own temporary files (hipcc left a folder per unit in /tmp) go with ours.
export TMPDIR="$OUT"

find_tool() {  # $1: env override, $2: name, $3...: fallback paths
  local override="$1" name="$2"
  shift 2
  if [ -n "$override" ]; then command -v "$override" && return 0; return 1; fi
  command -v "$name" && return 0
  for p in "$@"; do [ -x "$p" ] && { echo "$p"; return 0; }; done
  return 1
}

find_nvcc() {
  find_tool "${NVCC:-}" nvcc /usr/local/bin/nvcc /usr/local/cuda/bin/nvcc
}

run_timed() {  # $1: label, rest: command
  local label="$1"
  shift
  echo "+ $*"
  local start=$SECONDS
  if "$@"; then
    echo "ok: $label ($((SECONDS - start)) s)"
  else
    echo "FAILED: $label ($((SECONDS - start)) s)"
    return 1
  fi
}

check_cuda_kernels() {
  local nvcc
  nvcc="$(find_nvcc)" ||
    { echo "SKIP cuda-kernels: nvcc not found (set NVCC)"; return $SKIPPED; }
  local archs=(${CUDA_ARCHS:-80 90}) status=0 unit arch
  local release="${archs[-1]}" units=("$CSRC"/cuda/kernels_*.cu "$CSRC/cuda/hadamard_kernels.cu")
  for arch in "${archs[@]}"; do
    if [ "$arch" = "$release" ] || [ "${CUDA_OPTIMIZE_ALL:-0}" = 1 ]; then
      # As a release build compiles it, unit by unit: spills and local memory are errors, and for the
      # tensor-core kernels ptxas reports registers and shared memory (tests/ops/test_compile_check.py holds
      # them to the plan). (cicc at -O1, twice as fast, leaves arrays in local memory: a release build's errors.)
      for unit in "${units[@]}"; do
        local mode=(-Xptxas=-warn-spills,-warn-lmem-usage)
        case "$(basename "$unit")" in kernels_attention_tc_*.cu) mode+=(--resource-usage) ;; esac
        run_timed "cuda-kernels $(basename "$unit") sm_$arch" "$nvcc" -std=c++17 -O3 "${TORCH_NVCC_FLAGS[@]}" \
          -gencode "arch=compute_$arch,code=sm_$arch" "${mode[@]}" --Werror all-warnings \
          -c "$unit" -o "$OUT/$(basename "$unit" .cu)_sm$arch.o" || status=1
      done
    else
      # Unoptimized (cicc and ptxas at -O0), all units as one (the host side's headers compiled once: 34 s
      # instead of 53): every instantiation still goes through the front end and ptxas for this architecture
      # (its #if branches, and an instruction it lacks is an error), in a sixth of the time; registers and
      # spills are the release architecture's concern, and it compiles each unit on its own.
      run_timed "cuda-kernels all units sm_$arch unoptimized" "$nvcc" -std=c++17 -O3 "${TORCH_NVCC_FLAGS[@]}" \
        -gencode "arch=compute_$arch,code=sm_$arch" -Xcicc -O0 -Xptxas -O0 --Werror all-warnings \
        -I "$CSRC/cuda" -c "$(unity_of "${units[@]}")" -o "$OUT/kernels_sm$arch.o" || status=1
    fi
  done
  return $status
}

# torch/include of a CUDA torch wheel, unzipped once into the cache.
cuda_torch_include() {
  local dir="$CACHE_DIR/cuda-torch-include/$(basename "$TORCH_CUDA_WHEEL" .whl)"
  if [ ! -f "$dir/.complete" ]; then
    [ -f "$TORCH_CUDA_WHEEL" ] || return 1
    rm -rf "$dir" && mkdir -p "$dir"
    if command -v unzip >/dev/null; then
      unzip -q -o "$TORCH_CUDA_WHEEL" 'torch/include/*' -d "$dir" >&2 || return 1
    else
      python3 - "$TORCH_CUDA_WHEEL" "$dir" <<'PY' || return 1
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("torch/include/")])
PY
    fi
    touch "$dir/.complete"
  fi
  echo "$dir/torch/include"
}

check_cuda_bindings() {
  local nvcc include
  nvcc="$(find_nvcc)" ||
    { echo "SKIP cuda-bindings: nvcc not found (set NVCC)"; return $SKIPPED; }
  include="$(cuda_torch_include)" ||
    { echo "SKIP cuda-bindings: no CUDA torch wheel at $TORCH_CUDA_WHEEL (set TORCH_CUDA_WHEEL)"; return $SKIPPED; }
  # Both binding files in one translation unit: the torch headers, most of the time, are read once (54 s instead
  # of 107). A real build compiles them apart; an include one file lacks and the other supplies would show there.
  local unity="$OUT/bindings_unity.cu"
  printf '#include "cuda/hadamard.cu"\n#include "cuda/torch_bindings_cuda.cu"\n' > "$unity"
  run_timed "cuda-bindings torch_bindings_cuda.cu + hadamard.cu sm_90" "$nvcc" -std=c++20 -O2 "${TORCH_NVCC_FLAGS[@]}" \
    -gencode arch=compute_90,code=sm_90 -Xcompiler -fPIC -D_GLIBCXX_USE_CXX11_ABI=1 \
    -I "$CSRC" -I "$CSRC/cuda" -isystem "$include" -isystem "$include/torch/csrc/api/include" \
    -c "$unity" -o "$OUT/bindings_cuda.o"
}

find_hipcc() {
  find_tool "${HIPCC:-}" hipcc /usr/bin/hipcc /opt/rocm/bin/hipcc
}

# What the HIP checks pass hipcc (and torch's ROCm build passes it).
HIPCC_FLAGS=(-x hip -std=c++17 -O3 "${TORCH_HIPCC_FLAGS[@]}" -Werror -Wno-unused-command-line-argument)

# A file that includes each of "$@": analysed with -fsyntax-only, the units' shared headers are parsed once (one
# run of 7 s instead of eleven of 5), and every explicit instantiation of every unit is still instantiated.
unity_of() {
  local unity="$OUT/unity_$RANDOM.cu" unit
  for unit in "$@"; do echo "#include \"$unit\""; done > "$unity"
  echo "$unity"
}

check_hip_kernels() {
  local hipcc
  hipcc="$(find_hipcc)" ||
    { echo "SKIP hip-kernels: hipcc not found (apt-get install hipcc libamdhip64-dev, or set HIPCC)"; return $SKIPPED; }
  echo "note: HIP bindings are not compiled (no ROCm torch headers here); kernels only"
  local units=("$CSRC"/cuda/kernels_*.cu "$CSRC/cuda/hadamard_kernels.cu") status=0
  # Code for gfx90a, all units as one (HIP's headers and the shared templates compiled once: 59 s instead of
  # 76), unoptimized: every kernel still goes through the AMDGPU back end (instruction selection, registers),
  # in 21 s instead of 59 (HIP_OPTIMIZE=1: -O3, as a ROCm build). gfx940 analysed without code generation: the
  # sources branch on no AMD architecture (only on the wavefront size, which both share).
  local opt=-O0 label="gfx90a unoptimized"
  [ "${HIP_OPTIMIZE:-0}" = 1 ] && { opt=-O3; label=gfx90a; }
  HIP_PLATFORM=amd run_timed "hip-kernels all units $label" "$hipcc" "${HIPCC_FLAGS[@]}" "$opt" \
    --offload-arch=gfx90a -I "$CSRC/cuda" -c "$(unity_of "${units[@]}")" -o "$OUT/kernels_hip.o" || status=1
  HIP_PLATFORM=amd run_timed "hip-kernels all units gfx940 (no code)" "$hipcc" "${HIPCC_FLAGS[@]}" \
    --offload-arch=gfx940 -fsyntax-only -I "$CSRC/cuda" "$(unity_of "${units[@]}")" || status=1
  return $status
}

check_hip_hipify() {
  local hipcc python="${PYTHON:-python3}"
  hipcc="$(find_hipcc)" ||
    { echo "SKIP hip-hipify: hipcc not found (apt-get install hipcc libamdhip64-dev, or set HIPCC)"; return $SKIPPED; }
  "$python" -c "import torch.utils.hipify" 2>/dev/null ||
    { echo "SKIP hip-hipify: no torch.utils.hipify in $python (set PYTHON)"; return $SKIPPED; }
  cp -r "$CSRC" "$OUT/hipify"
  # The call torch.utils.cpp_extension makes for a ROCm torch: csrc/cuda/x.cu -> csrc/hip/x.hip.
  "$python" - "$OUT/hipify" <<'PY' || { echo "FAILED: hip-hipify (hipify)"; return 1; }
import glob, os, sys
from torch.utils.hipify import hipify_python
root = sys.argv[1]
sources = [os.path.abspath(p) for p in glob.glob(os.path.join(root, "cuda", "*.cu"))]
hipify_python.hipify(project_directory=root, output_directory=root, header_include_dirs=[root],
                     includes=[os.path.join(root, "*")], extra_files=sources, show_detailed=False,
                     show_progress=False, is_pytorch_extension=True, hipify_extra_files_only=True)
PY
  # Host and device sides analysed, every template instantiated, no code generated: hip-kernels generates the
  # same kernels' code; this checks that hipify's rewrite still compiles.
  local units=("$OUT"/hipify/hip/kernels_*.hip "$OUT/hipify/hip/hadamard_kernels.hip")
  HIP_PLATFORM=amd run_timed "hip-hipify all units gfx90a" "$hipcc" "${HIPCC_FLAGS[@]}" --offload-arch=gfx90a \
    -fsyntax-only -I "$OUT/hipify" -I "$OUT/hipify/hip" "$(unity_of "${units[@]}")"
}

# What decides a check's result: the sources, this script, the compilers, the torch headers and the settings. A
# check that passed is not compiled again for the same inputs (as ccache would not): its output is replayed from
# CACHE_DIR/compile-check. Failures and skips are never kept; FP8KV_COMPILE_CHECK_CACHE=0 compiles anyway.
inputs_key() {  # $1: the check's function
  local nvcc hipcc
  {
    echo "$1 ${CUDA_ARCHS:-} ${CUDA_OPTIMIZE_ALL:-} ${HIP_OPTIMIZE:-} $TORCH_CUDA_WHEEL"
    stat -c %s "$TORCH_CUDA_WHEEL" 2>/dev/null || true
    cat "$0"
    (cd "$ROOT" && find csrc -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
    if nvcc="$(find_nvcc)"; then
      echo "$nvcc"; "$nvcc" --version 2>&1 || true
    fi
    if hipcc="$(find_hipcc)"; then
      echo "$hipcc"; HIP_PLATFORM=amd "$hipcc" --version 2>&1 || true
    fi
    "${PYTHON:-python3}" -c "import importlib.metadata as m; print('torch', m.version('torch'))" 2>&1 || true
  } | sha256sum | cut -c1-20
}

run_cached() {  # $1: the check's function
  local check="$1" key passed
  key="$(inputs_key "$check")"
  passed="$CACHE_DIR/compile-check/$check-$key.out"
  if [ "${FP8KV_COMPILE_CHECK_CACHE:-1}" != 0 ] && [ -f "$passed" ]; then
    echo "cached: $check passed on these inputs (key $key, $(date -r "$passed" '+%Y-%m-%d %H:%M')); its output" \
         "follows. FP8KV_COMPILE_CHECK_CACHE=0 compiles again."
    cat "$passed"
    return 0
  fi
  local status
  { status=0; "$check" 2>&1 || status=$?; echo $status > "$OUT/$check.rc"; } | tee "$OUT/$check.out"
  status="$(cat "$OUT/$check.rc")"
  if [ "$status" = 0 ] && mkdir -p "$CACHE_DIR/compile-check" 2>/dev/null; then
    cp "$OUT/$check.out" "$passed.tmp.$$" && mv -f "$passed.tmp.$$" "$passed" || rm -f "$passed.tmp.$$"
  fi
  return $status
}

# Run the named checks; a skip does not hide a failure, and all-skipped reports a skip.
run_checks() {
  local failed=0 passed=0 status
  for check in "$@"; do
    status=0
    run_cached "$check" || status=$?
    case $status in
      0) passed=1 ;;
      "$SKIPPED") ;;
      *) failed=1 ;;
    esac
  done
  [ $failed = 0 ] || return 1
  [ $passed = 1 ] || return $SKIPPED
}

case "${1:-all}" in
  cuda-kernels) run_checks check_cuda_kernels ;;
  cuda-bindings) run_checks check_cuda_bindings ;;
  cuda) run_checks check_cuda_kernels check_cuda_bindings ;;
  hip-kernels) run_checks check_hip_kernels ;;
  hip-hipify) run_checks check_hip_hipify ;;
  hip) run_checks check_hip_kernels check_hip_hipify ;;
  all) run_checks check_cuda_kernels check_cuda_bindings check_hip_kernels check_hip_hipify ;;
  *) echo "usage: $0 [cuda|cuda-kernels|cuda-bindings|hip|hip-kernels|hip-hipify|all]" >&2; exit 2 ;;
esac
