#!/usr/bin/env bash
# A stock NixlConnector P/D pair with P at --tensor-parallel-size 2 and D at
# PAIR_D_TP (1 or 2), both on this host, plus `kvlens proxy` in front of them;
# sends one request through the router (pull by default) and reports its HTTP
# status. Each server and the router run in a process group of their own,
# stopped as a whole on exit. See docs/tensor-parallel.md.
#
#   tools/tp_pair_probe.sh                  # P TP2 -> D TP1, pull
#   PAIR_D_TP=2 tools/tp_pair_probe.sh      # P TP2 -> D TP2, pull
#
# Settings: PAIR_P_TP (2), PAIR_D_TP (1), PAIR_MODE (pull|push), PAIR_P_BIND
# ("0|1"), PAIR_D_BIND ("1" for TP 1, "0|1" for TP 2), PAIR_TIMEOUT (s to wait
# for both /health, 420), PAIR_MODEL (/tmp/tpmodel), PAIR_LOGDIR (/tmp/tp_pair).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
P_TP=${PAIR_P_TP:-2}
D_TP=${PAIR_D_TP:-1}
MODE=${PAIR_MODE:-pull}
P_BIND=${PAIR_P_BIND:-0|1}
if [ "$D_TP" = 1 ]; then D_BIND=${PAIR_D_BIND:-1}; else D_BIND=${PAIR_D_BIND:-0|1}; fi
TIMEOUT=${PAIR_TIMEOUT:-420}
MODEL=${PAIR_MODEL:-/tmp/tpmodel}
LOGS=${PAIR_LOGDIR:-/tmp/tp_pair}
P_PORT=8131 D_PORT=8132 R_PORT=8133 P_SIDE=5631 D_SIDE=5632
mkdir -p "$LOGS"

if [ ! -f "$MODEL/config.json" ]; then
  "$PY" -c "import pathlib, sys; from kvlens.model import ensure_model; ensure_model(pathlib.Path(sys.argv[1]))" "$MODEL" >/dev/null 2>&1 \
    || { echo "tp_pair_probe: could not make the model in $MODEL"; exit 2; }
fi
if [ "$MODE" = push ]; then CONN=NixlPushConnector; else CONN=NixlConnector; fi

GROUPS_=()
stop_all() {
  for g in "${GROUPS_[@]}"; do kill -TERM -- "-$g" 2>/dev/null; done
  for _ in $(seq 1 20); do
    alive=""; for g in "${GROUPS_[@]}"; do kill -0 -- "-$g" 2>/dev/null && alive=1; done
    [ -z "$alive" ] && return 0; sleep 0.5
  done
  for g in "${GROUPS_[@]}"; do kill -KILL -- "-$g" 2>/dev/null; done
}
trap stop_all EXIT INT TERM

server() {  # name port side_port tp bind role engine_id
  local ktc="{\"kv_connector\":\"$CONN\",\"kv_role\":\"$6\",\"kv_buffer_device\":\"cpu\",\"engine_id\":\"$7\"}"
  echo "tp_pair_probe: $1: VLLM_CPU_OMP_THREADS_BIND=$5 --tensor-parallel-size $4 --kv-transfer-config $ktc"
  setsid env VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
    VLLM_CPU_OMP_THREADS_BIND="$5" VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$3" \
    timeout -k 10 $((TIMEOUT + 300)) "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --host 127.0.0.1 --port "$2" --dtype float32 --enforce-eager --max-model-len 4096 \
    --tensor-parallel-size "$4" --kv-transfer-config "$ktc" >"$LOGS/$1.log" 2>&1 &
  GROUPS_+=($!)
}

t0=$(date +%s)
server p "$P_PORT" "$P_SIDE" "$P_TP" "$P_BIND" kv_producer p0
server d "$D_PORT" "$D_SIDE" "$D_TP" "$D_BIND" kv_consumer d0
setsid timeout -k 10 $((TIMEOUT + 300)) "$PY" -m kvlens.cli proxy --prefill "http://127.0.0.1:$P_PORT" \
  --decode "http://127.0.0.1:$D_PORT" --mode "$MODE" --port "$R_PORT" --no-telemetry \
  --prefill-side-port "$P_SIDE" --prefill-tp-size "$P_TP" >"$LOGS/router.log" 2>&1 &
GROUPS_+=($!)

healthy() { curl -sf -o /dev/null "http://127.0.0.1:$1/health"; }
p_up="" d_up=""
while [ $(( $(date +%s) - t0 )) -lt "$TIMEOUT" ]; do
  [ -z "$p_up" ] && healthy "$P_PORT" && p_up=$(( $(date +%s) - t0 )) && echo "tp_pair_probe: P healthy after ${p_up}s"
  [ -z "$d_up" ] && healthy "$D_PORT" && d_up=$(( $(date +%s) - t0 )) && echo "tp_pair_probe: D healthy after ${d_up}s"
  [ -n "$p_up" ] && [ -n "$d_up" ] && break
  for g in "${GROUPS_[@]:0:2}"; do kill -0 "$g" 2>/dev/null || { echo "tp_pair_probe: a server exited early"; break 2; }; done
  sleep 2
done
if [ -z "$p_up" ] || [ -z "$d_up" ]; then
  echo "tp_pair_probe: RESULT pair not healthy after $(( $(date +%s) - t0 ))s (logs: $LOGS)"
  for n in p d; do echo "--- $n"; tail -n 8 "$LOGS/$n.log"; done
  exit 1
fi
for _ in $(seq 1 30); do healthy "$R_PORT" && break; sleep 1; done
code=$(curl -s -m 180 -o "$LOGS/reply.json" -w '%{http_code}' "http://127.0.0.1:$R_PORT/v1/completions" \
  -H 'Content-Type: application/json' \
  -d "{\"model\":\"$MODEL\",\"prompt\":\"$(printf 'tensor parallel handoff %.0s' $(seq 1 40))\",\"max_tokens\":8}")
echo "tp_pair_probe: router HTTP $code: $(head -c 300 "$LOGS/reply.json")"
grep -h -iE "nixl|handshake|tp_ratio|remote" "$LOGS/p.log" "$LOGS/d.log" | grep -iE "error|warn|handshake|ratio" | tail -n 8
echo "tp_pair_probe: RESULT mode=$MODE p_tp=$P_TP d_tp=$D_TP p_bind='$P_BIND' d_bind='$D_BIND' p_healthy_s=$p_up d_healthy_s=$d_up router=$code"
[ "$code" = 200 ]
