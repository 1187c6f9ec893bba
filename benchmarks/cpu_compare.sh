#!/usr/bin/env bash
# Side-by-side CPU comparison: shardserve (-tp 1 and -tp 2), the vLLM CPU peer and plain HF
# transformers, all on the same model, with the same client-side measurements.
#
#   usage: benchmarks/cpu_compare.sh MODEL.gguf
#
# Steps
#   1. HF safetensors copy of the GGUF for vLLM and transformers (HF_DIR; converted once with
#      benchmarks/convert_gguf_to_hf.py if it has no config.json yet).
#   2. shardserve serve MODEL.gguf -tp 1 --port 8021, then -tp 2 --port 8022, one at a time: start,
#      wait for GET /health == 200 (start-up seconds recorded), run benchmarks/openai_load.py, stop.
#   3. vLLM CPU peer on 8011: used as is if it already answers /v1/models, otherwise started with
#      ../shared/peer/vllm_cpu.sh (start-up timed). It is left running afterwards.
#   4. benchmarks/hf_cpu_baseline.py on HF_DIR.
#   5. A markdown table: system | start-up s | batch-1 decode tok/s | 16-concurrent output tok/s.
#
# Environment (all optional)
#   OUT_DIR        results folder            (default /tmp/bench/compare-YYYYmmdd-HHMMSS)
#   HF_DIR         HF copy of the model      (default /tmp/<gguf name without .gguf>-hf)
#   PYTHON         interpreter for the client/baseline scripts (default python3)
#   SHARDSERVE     command that runs the CLI (default: `shardserve` if on PATH, else
#                  "$PYTHON -m shardserve.cli")
#   SS_ARGS        extra arguments for shardserve serve (e.g. "--dtype bfloat16")
#   SS_PORT_TP1 / SS_PORT_TP2   (8021 / 8022)       PEER_PORT (8011)
#   PEER_SCRIPT    (default <repo>/../shared/peer/vllm_cpu.sh)
#   MAX_TOKENS (128)  CONCURRENCY (16)  REPEATS (3)  MAX_MODEL_LEN (2048)
#   START_TIMEOUT  seconds to wait for a server to become healthy (default 900)
#   SKIP           space-separated subset of: tp1 tp2 vllm hf
set -euo pipefail

GGUF=$(realpath "${1:?usage: cpu_compare.sh MODEL.gguf}")
[ -f "$GGUF" ] || { echo "no such file: $GGUF" >&2; exit 2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
PYTHON=${PYTHON:-python3}
if [ -z "${SHARDSERVE:-}" ]; then
  if command -v shardserve >/dev/null 2>&1; then SHARDSERVE=shardserve; else SHARDSERVE="$PYTHON -m shardserve.cli"; fi
fi
OUT_DIR=${OUT_DIR:-/tmp/bench/compare-$(date +%Y%m%d-%H%M%S)}
STATE_DIR=/tmp/bench                      # pid files / peer start-up record shared between runs
NAME=$(basename "$GGUF" .gguf)
HF_DIR=${HF_DIR:-/tmp/${NAME}-hf}
SS_PORT_TP1=${SS_PORT_TP1:-8021}
SS_PORT_TP2=${SS_PORT_TP2:-8022}
PEER_PORT=${PEER_PORT:-8011}
PEER_SCRIPT=${PEER_SCRIPT:-$REPO/../shared/peer/vllm_cpu.sh}
MAX_TOKENS=${MAX_TOKENS:-128}
CONCURRENCY=${CONCURRENCY:-16}
REPEATS=${REPEATS:-3}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048}
START_TIMEOUT=${START_TIMEOUT:-900}
SKIP=" ${SKIP:-} "
mkdir -p "$OUT_DIR" "$STATE_DIR"
echo "results -> $OUT_DIR"

log() { echo "[$(date +%H:%M:%S)] $*"; }
skipped() { [[ "$SKIP" == *" $1 "* ]]; }
now() { date +%s.%N; }
http_ok() { [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$1" || true)" = 200 ]; }
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# wait_healthy URL PID -> prints seconds waited; fails if PID dies or START_TIMEOUT passes
wait_healthy() {
  local url=$1 pid=$2 t0 t
  t0=$(now)
  while :; do
    if http_ok "$url"; then
      t=$(now); echo "$t - $t0" | bc -l | xargs printf '%.1f\n'; return 0
    fi
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
      echo "process $pid exited before $url answered" >&2; return 1
    fi
    if [ "$(echo "$(now) - $t0 > $START_TIMEOUT" | bc -l)" = 1 ]; then
      echo "timed out after ${START_TIMEOUT}s waiting for $url" >&2; return 1
    fi
    sleep 1
  done
}

# stop_group PID: TERM the process group we started (setsid made PID its leader), KILL after 30 s
stop_group() {
  local pid=$1 i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 30); do kill -0 "$pid" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
}

# record SYSTEM STARTUP_S JSON_FILE  (one line per system in $OUT_DIR/systems.tsv)
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$OUT_DIR/systems.tsv"; }
: > "$OUT_DIR/systems.tsv"

load() {  # load LABEL BASE_URL MODEL JSON
  "$PYTHON" "$HERE/openai_load.py" --base-url "$2" --model "$3" --label "$1" \
    --max-tokens "$MAX_TOKENS" --concurrency "$CONCURRENCY" --repeats "$REPEATS" --json "$4"
}

# ---------------------------------------------------------------------------------------------
run_shardserve() {  # run_shardserve TP PORT
  local tp=$1 port=$2 label="shardserve -tp $1" pidfile="$STATE_DIR/shardserve-$2.pid" pid startup
  local json="$OUT_DIR/shardserve-tp$1.json" logf="$OUT_DIR/shardserve-tp$1.log"
  # restart: stop a server this script left on the port earlier; refuse to touch anything else
  if [ -f "$pidfile" ]; then stop_group "$(cat "$pidfile")"; rm -f "$pidfile"; fi
  if port_busy "$port"; then
    echo "port $port is in use by a process this script did not start; skipping $label" >&2
    record "$label" "port busy" ""; return 0
  fi
  log "starting $label on :$port (log $logf)"
  # shellcheck disable=SC2086
  (cd "$REPO" && exec setsid $SHARDSERVE serve "$GGUF" -tp "$tp" --port "$port" \
      --served-model-name "shardserve-tp$tp" --max-model-len "$MAX_MODEL_LEN" ${SS_ARGS:-}) \
      > "$logf" 2>&1 &
  pid=$!
  echo "$pid" > "$pidfile"
  if startup=$(wait_healthy "http://127.0.0.1:$port/health" "$pid"); then
    log "$label healthy after ${startup}s"
    if load "$label" "http://127.0.0.1:$port/v1" "shardserve-tp$tp" "$json"; then
      record "$label" "$startup" "$json"
    else
      echo "benchmark against $label failed (see above)" >&2; record "$label" "$startup" ""
    fi
  else
    echo "$label did not come up; last log lines:" >&2; tail -20 "$logf" >&2 || true
    record "$label" "failed" ""
  fi
  stop_group "$pid"; rm -f "$pidfile"
}

ensure_hf_dir() {
  if [ ! -f "$HF_DIR/config.json" ]; then
    log "converting $GGUF -> $HF_DIR"
    "$PYTHON" "$HERE/convert_gguf_to_hf.py" "$GGUF" "$HF_DIR"
  fi
}

run_vllm() {
  local label="vLLM CPU (peer)" json="$OUT_DIR/vllm-peer.json" rec="$STATE_DIR/peer-start-$PEER_PORT.txt"
  local startup pid
  if http_ok "http://127.0.0.1:$PEER_PORT/v1/models"; then
    startup="$(cat "$rec" 2>/dev/null || echo '?') (already up)"
    log "vLLM peer already answering on :$PEER_PORT"
  else
    ensure_hf_dir
    [ -x "$PEER_SCRIPT" ] || [ -f "$PEER_SCRIPT" ] || { echo "no peer script at $PEER_SCRIPT" >&2; record "$label" "failed" ""; return 0; }
    log "starting vLLM peer on :$PEER_PORT via $PEER_SCRIPT (first use builds its venv)"
    local t0; t0=$(now)
    pid=$(bash "$PEER_SCRIPT" "$HF_DIR" "$PEER_PORT" | tail -1)
    log "vLLM peer PID $pid"
    if wait_healthy "http://127.0.0.1:$PEER_PORT/v1/models" "$pid" > /dev/null; then
      startup=$(echo "$(now) - $t0" | bc -l | xargs printf '%.1f')
      echo "$startup" > "$rec"
      log "vLLM peer up after ${startup}s (includes venv build on first use); left running, PID $pid"
    else
      record "$label" "failed" ""; return 0
    fi
  fi
  if load "$label" "http://127.0.0.1:$PEER_PORT/v1" peer "$json"; then
    record "$label" "$startup" "$json"
  else
    record "$label" "$startup" ""
  fi
}

run_hf() {
  local label="HF transformers (fp32, eager)" json="$OUT_DIR/hf-baseline.json"
  ensure_hf_dir
  log "HF transformers baseline on $HF_DIR"
  if "$PYTHON" "$HERE/hf_cpu_baseline.py" "$HF_DIR" --max-new-tokens "$MAX_TOKENS" \
       --batch "$CONCURRENCY" --repeats "$REPEATS" --json "$json"; then
    record "$label" "$("$PYTHON" -c 'import json,sys; print("%.1f (load)" % json.load(open(sys.argv[1]))["load_s"])' "$json")" "$json"
  else
    record "$label" "failed" ""
  fi
}

# ---------------------------------------------------------------------------------------------
skipped tp1  || run_shardserve 1 "$SS_PORT_TP1"
skipped tp2  || run_shardserve 2 "$SS_PORT_TP2"
skipped vllm || run_vllm
skipped hf   || run_hf

"$PYTHON" - "$OUT_DIR/systems.tsv" "$CONCURRENCY" <<'EOF' | tee "$OUT_DIR/table.md"
import json, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
conc = sys.argv[2]
def f(x):
    return "n/a" if x is None else f"{x:.1f}"
print(f"\n| system | start-up s | batch-1 decode tok/s | {conc}-concurrent output tok/s |")
print("|---|---|---|---|")
notes = []
for name, startup, path in rows:
    b1 = cc = None
    if path:
        r = json.load(open(path))
        b1 = (r.get("batch1") or {}).get("decode_tok_s_median")
        c = r.get("concurrent") or r.get("batched") or {}
        cc = c.get("output_tok_s")
        for key in ("batch1", "concurrent"):
            if key in r and not r[key].get("all_full_length", True):
                notes.append(f"{name}: {key} produced fewer than the requested tokens")
    print(f"| {name} | {startup} | {f(b1)} | {f(cc)} |")
for n in notes:
    print(f"\nnote: {n}")
EOF
echo "full results: $OUT_DIR"
