#!/usr/bin/env bash
# The operator's manual runbook (shared/seed) as a plain script: ssh and the docker CLI, no flow.
#
#   bench/reference_runbook.sh CLUSTER_TOML POLL_S
#
# 1. stop the autostart units and force-remove the old containers on every node;
# 2. check that every GPU is clear;
# 3. start the Ray head, 4. join the workers, 5. check that Ray sees every GPU;
# 6. launch `vllm serve` in its own container on the head;
# 7. poll /v1/models every POLL_S seconds until it names the model (the operator: 60 s;
#    NVIDIA's playbook: 10 s); 8. one curl chat request, printing `content` (None is healthy).
#
# The containers and their docker run lines are the flow's own (bench/runbook_args.py reads them
# from vllm_redeploy/plan.py). Each step prints "@@ <unix time> <step>" when it is done.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 CLUSTER_TOML POLL_S" >&2
  exit 2
fi
config=$1
poll_s=$2
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
eval "$(cd "$repo" && "$python" -m bench.runbook_args "$config")"

mark() { echo "@@ $(date +%s.%N) $1"; }

# on NODE_INDEX COMMAND...: run a command on a node over ssh (its login env gives DOCKER_HOST).
on() {
  local i=$1
  shift
  ssh -i "$SSH_KEY" -o UserKnownHostsFile="$KNOWN_HOSTS" -o BatchMode=yes \
    -p "${PORTS[$i]}" "${NODES[$i]}" "$@"
}

mark begin

for i in "${!NODES[@]}"; do
  on "$i" "${UNITS:+systemctl stop $UNITS;} docker ps -a --format '{{.Names}}' | grep -E '$STALE' \
    | xargs -r docker rm -f" >/dev/null
done
mark stop-autostart

for i in "${!NODES[@]}"; do
  until [ -z "$(on "$i" nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ]; do
    sleep 1
  done
done
mark gpus-clear

on "$HEAD" "${RAY_RUN[$HEAD]}" >/dev/null
until on "$HEAD" docker exec "$RAY_CONTAINER" ray health-check --address "$RAY_ADDRESS" \
  >/dev/null 2>&1; do
  sleep 1
done
mark ray-head

for i in "${!NODES[@]}"; do
  if [ "$i" != "$HEAD" ]; then
    on "$i" "${RAY_RUN[$i]}" >/dev/null
  fi
done
mark join-workers

until on "$HEAD" docker exec "$RAY_CONTAINER" ray status --address "$RAY_ADDRESS" 2>/dev/null \
  | grep -q "/$GPUS.0 GPU"; do
  sleep 1
done
mark cluster-check

on "$HEAD" "$ENGINE_RUN" >/dev/null
mark launch-vllm

until curl -sf --max-time 5 "$API/v1/models" | grep -q "\"$MODEL\""; do
  sleep "$poll_s"
done
mark ready

body='{"model": "'$MODEL'", "messages": [{"role": "user", "content": "Say hello in one sentence."}],
  "max_tokens": 50, "temperature": 0}'
curl -sf --max-time 60 "$API/v1/chat/completions" -H 'Content-Type: application/json' -d "$body" \
  | "$python" -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])'
mark probe
