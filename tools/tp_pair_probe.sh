#!/usr/bin/env bash
# A stock NIXL P/D pair with P at --tensor-parallel-size 2 and D at PAIR_D_TP
# (1 or 2), both on this host, plus `kvlens proxy` in front of them; sends one
# greedy request through the router (pull by default), reports its HTTP
# status, compares D's text with P serving the same prompt alone, and counts
# P ranks whose KV lease expired unread. Each server and the router run in a
# process group of their own, stopped as a whole on exit.
# See docs/tensor-parallel.md.
#
#   tools/tp_pair_probe.sh                  # P TP2 -> D TP1, pull
#   PAIR_D_TP=2 tools/tp_pair_probe.sh      # P TP2 -> D TP2, pull
#
# Settings: PAIR_P_TP (2), PAIR_D_TP (1), PAIR_MODE (pull|push), PAIR_P_BIND
# ("0|1"), PAIR_D_BIND ("1" for TP 1, "0|1" for TP 2), PAIR_TIMEOUT (s to wait
# for both /health, 420), PAIR_SETTLE (s to wait past vLLM's 30 s KV lease, 40),
# PAIR_MODEL (/tmp/tpmodel), PAIR_LOGDIR (/tmp/tp_pair).
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

PGIDS=()
stop_all() {
  for g in "${PGIDS[@]}"; do kill -TERM -- "-$g" 2>/dev/null; done
  for _ in $(seq 1 20); do
    alive=""
    for g in "${PGIDS[@]}"; do kill -0 -- "-$g" 2>/dev/null && alive=1; done
    [ -z "$alive" ] && return 0
    sleep 0.5
  done
  for g in "${PGIDS[@]}"; do kill -KILL -- "-$g" 2>/dev/null; done
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
  PGIDS+=($!)
}

t0=$(date +%s)
server p "$P_PORT" "$P_SIDE" "$P_TP" "$P_BIND" kv_producer p0
server d "$D_PORT" "$D_SIDE" "$D_TP" "$D_BIND" kv_consumer d0
setsid timeout -k 10 $((TIMEOUT + 300)) "$PY" -m kvlens.cli proxy --prefill "http://127.0.0.1:$P_PORT" \
  --decode "http://127.0.0.1:$D_PORT" --mode "$MODE" --port "$R_PORT" --no-telemetry \
  --prefill-side-port "$P_SIDE" --prefill-tp-size "$P_TP" >"$LOGS/router.log" 2>&1 &
PGIDS+=($!)

healthy() { curl -sf -o /dev/null "http://127.0.0.1:$1/health"; }
p_up="" d_up=""
while [ $(( $(date +%s) - t0 )) -lt "$TIMEOUT" ]; do
  [ -z "$p_up" ] && healthy "$P_PORT" && p_up=$(( $(date +%s) - t0 )) && echo "tp_pair_probe: P healthy after ${p_up}s"
  [ -z "$d_up" ] && healthy "$D_PORT" && d_up=$(( $(date +%s) - t0 )) && echo "tp_pair_probe: D healthy after ${d_up}s"
  [ -n "$p_up" ] && [ -n "$d_up" ] && break
  for g in "${PGIDS[@]:0:2}"; do kill -0 "$g" 2>/dev/null || { echo "tp_pair_probe: a server exited early"; break 2; }; done
  sleep 2
done
if [ -z "$p_up" ] || [ -z "$d_up" ]; then
  echo "tp_pair_probe: RESULT pair not healthy after $(( $(date +%s) - t0 ))s (logs: $LOGS)"
  for n in p d; do echo "--- $n"; tail -n 8 "$LOGS/$n.log"; done
  exit 1
fi
for _ in $(seq 1 30); do healthy "$R_PORT" && break; sleep 1; done

PROMPT="$(printf 'tensor parallel handoff %.0s' $(seq 1 40))"
BODY="{\"model\":\"$MODEL\",\"prompt\":\"$PROMPT\",\"max_tokens\":8,\"temperature\":0}"
code=$(curl -s -m 180 -o "$LOGS/reply.json" -w '%{http_code}' "http://127.0.0.1:$R_PORT/v1/completions" \
  -H 'Content-Type: application/json' -d "$BODY")
echo "tp_pair_probe: router HTTP $code: $(head -c 300 "$LOGS/reply.json")"
# The same prompt served by P alone (no handoff): the greedy text must match
# D's, which it cannot when D decodes over KV it did not get from every P rank.
curl -s -m 180 -o "$LOGS/p_alone.json" "http://127.0.0.1:$P_PORT/v1/completions" \
  -H 'Content-Type: application/json' -d "$BODY"
txt() { "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['choices'][0]['text'])" "$1" 2>/dev/null; }
same=no
[ "$(txt "$LOGS/reply.json")" = "$(txt "$LOGS/p_alone.json")" ] && same=yes
echo "tp_pair_probe: P alone: '$(txt "$LOGS/p_alone.json")' | via D: '$(txt "$LOGS/reply.json")' | same=$same"
# A P rank whose blocks no D rank reported read keeps them until vLLM's KV
# lease (30 s by default) runs out, then logs it: wait past the lease, count.
sleep "${PAIR_SETTLE:-40}"
expired=$(grep -c "Releasing expired KV blocks" "$LOGS/p.log")
grep -h "Releasing expired KV blocks\|Transfer plan" "$LOGS/p.log" "$LOGS/d.log" | cut -c1-260 | sort -u | tail -n 6
echo "tp_pair_probe: RESULT mode=$MODE p_tp=$P_TP d_tp=$D_TP p_bind='$P_BIND' d_bind='$D_BIND'" \
  "p_healthy_s=$p_up d_healthy_s=$d_up router=$code same_text=$same p_expired_leases=$expired"
[ "$code" = 200 ]
