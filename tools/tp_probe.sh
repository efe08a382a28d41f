#!/usr/bin/env bash
# Start ONE vLLM CPU server at --tensor-parallel-size N, wait (bounded) for
# /health, send one completion, report, and always stop the server's whole
# process group. See docs/tensor-parallel.md for what was found with it.
#
#   tools/tp_probe.sh                      # the working TP=2 configuration
#   TP_PROBE_BIND=auto tools/tp_probe.sh   # vLLM's default binding (fails on 1 NUMA node)
#   TP_PROBE_KV=producer tools/tp_probe.sh # with a NixlConnector kv_transfer_config
#
# Settings (environment):
#   TP_PROBE_TP        tensor-parallel size (2)
#   TP_PROBE_BIND      VLLM_CPU_OMP_THREADS_BIND ("0|1": one core per rank)
#   TP_PROBE_RESERVED  VLLM_CPU_NUM_OF_RESERVED_CPU ("" = leave unset)
#   TP_PROBE_KV        "" (no connector), producer or consumer (NixlConnector)
#   TP_PROBE_PORT      HTTP port (8123); TP_PROBE_SIDE_PORT NIXL side channel (5600)
#   TP_PROBE_TIMEOUT   seconds to wait for /health (300)
#   TP_PROBE_MODEL     model dir (/tmp/tpmodel; made with kvlens.model.ensure_model)
#   TP_PROBE_LOG       server log (/tmp/tp_probe.log)
# Exit status: 0 when /health answered and the completion returned 200.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TP=${TP_PROBE_TP:-2}
BIND=${TP_PROBE_BIND-0|1}
RESERVED=${TP_PROBE_RESERVED-}
KV=${TP_PROBE_KV:-}
PORT=${TP_PROBE_PORT:-8123}
SIDE_PORT=${TP_PROBE_SIDE_PORT:-5600}
TIMEOUT=${TP_PROBE_TIMEOUT:-300}
MODEL=${TP_PROBE_MODEL:-/tmp/tpmodel}
LOG=${TP_PROBE_LOG:-/tmp/tp_probe.log}

if [ ! -f "$MODEL/config.json" ]; then
  "$PY" -c "import pathlib, sys; from kvlens.model import ensure_model; ensure_model(pathlib.Path(sys.argv[1]))" "$MODEL" >/dev/null 2>&1 \
    || { echo "tp_probe: could not make the model in $MODEL"; exit 2; }
fi

args=(--model "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype float32 --enforce-eager
      --max-model-len 4096 --tensor-parallel-size "$TP")
case "$KV" in
  producer) args+=(--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu","engine_id":"p0"}') ;;
  consumer) args+=(--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cpu","engine_id":"d0"}') ;;
  "") ;;
  *) echo "tp_probe: TP_PROBE_KV must be empty, producer or consumer"; exit 2 ;;
esac

envs=(VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
      VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$SIDE_PORT")
[ -n "$BIND" ] && envs+=(VLLM_CPU_OMP_THREADS_BIND="$BIND")
[ -n "$RESERVED" ] && envs+=(VLLM_CPU_NUM_OF_RESERVED_CPU="$RESERVED")

echo "tp_probe: env ${envs[*]}"
echo "tp_probe: $PY -m vllm.entrypoints.openai.api_server ${args[*]}"
t0=$(date +%s)
# setsid: the server and all its workers get a process group of their own,
# which the trap below stops as a whole (never by name).
setsid env "${envs[@]}" timeout -k 10 $((TIMEOUT + 120)) \
  "$PY" -m vllm.entrypoints.openai.api_server "${args[@]}" >"$LOG" 2>&1 &
PGID=$!
stop() {
  kill -TERM -- "-$PGID" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 -- "-$PGID" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL -- "-$PGID" 2>/dev/null
}
trap stop EXIT INT TERM

up=""
while [ $(( $(date +%s) - t0 )) -lt "$TIMEOUT" ]; do
  if ! kill -0 "$PGID" 2>/dev/null; then echo "tp_probe: server exited early"; break; fi
  if curl -sf -o /dev/null "http://127.0.0.1:$PORT/health"; then up=1; break; fi
  sleep 1
done
dt=$(( $(date +%s) - t0 ))
grep -E "OpenMP thread binding|local_rank=|reserve|reserved_cpus|Error|error|assert" "$LOG" | grep -v "^\s*$" | head -20
if [ -z "$up" ]; then
  echo "tp_probe: RESULT not healthy after ${dt}s (log: $LOG)"
  tail -n 15 "$LOG"
  exit 1
fi
echo "tp_probe: /health OK after ${dt}s"
code=$(curl -s -o /tmp/tp_probe.out -w '%{http_code}' "http://127.0.0.1:$PORT/v1/completions" \
  -H 'Content-Type: application/json' \
  -d "{\"model\":\"$MODEL\",\"prompt\":\"hello tensor parallel world\",\"max_tokens\":8}")
echo "tp_probe: completion HTTP $code: $(head -c 300 /tmp/tp_probe.out)"
echo "tp_probe: RESULT tp=$TP bind='$BIND' reserved='${RESERVED:-unset}' kv='${KV:-none}' healthy_after_s=$dt completion=$code"
[ "$code" = 200 ]
