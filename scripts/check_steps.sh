# Shared by the acceptance runs (gpu_check.sh, cpu_check.sh), sourced after they set `out` (the folder for
# logs and figures) and `steps` (the steps asked for). Each step's output goes to $out/NAME.log; a step may
# leave a one-line $out/NAME.note for the summary. `status` ends 1 when a step failed.
# shellcheck shell=bash
summary=()
status=0

want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

# step NAME COMMAND...: run, time, record.
step() {
  local name="$1" start=$SECONDS
  shift
  echo "== $name"
  if "$@" >"$out/$name.log" 2>&1; then
    summary+=("$name ok $((SECONDS - start))")
  else
    status=1
    summary+=("$name FAIL $((SECONDS - start))")
    tail -30 "$out/$name.log"
  fi
}

# A step's note is written after it ran, so the summary reads them at the end. Up to 1500 characters: the GPU
# run's kernels note holds a figure set per measured shape.
note() { [ -f "$out/$1.note" ] && head -c 1500 "$out/$1.note" | tr '\n' ' '; }

# print_summary: a row per step run (result, seconds, its note or its log), also written to $out/summary.txt.
print_summary() {
  local row name result secs
  for row in "${summary[@]}"; do
    read -r name result secs <<< "$row"
    if [ "$result" = ok ]; then
      printf '%-11s %-5s %5ss  %s\n' "$name" ok "$secs" "$(note "$name")"
    else
      printf '%-11s %-5s %5ss  see %s\n' "$name" FAIL "$secs" "$out/$name.log"
    fi
  done | tee "$out/summary.txt"
}
