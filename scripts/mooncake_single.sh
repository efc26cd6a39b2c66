#!/usr/bin/env bash
# Mooncake for one sglang node: a master with its embedded HTTP metadata
# server and one storage node, both on one host, in the foreground.
set -euo pipefail
source "$(dirname "$0")/_mooncake_common.sh"

usage() {
  cat <<'TXT'
usage: scripts/mooncake_single.sh [--ssd-dir DIR [--ssd-size SIZE]] [--help]

Starts, on this host:
  * mooncake_master with its embedded HTTP metadata server;
  * one storage node (python -m mooncake_span.storage_node) that holds the
    cache, so it survives restarts of the sglang server. With --ssd-dir it
    also keeps every object on DIR/node0 (DIR must exist; --ssd-size caps
    it, default 90% of the disk), so the cache survives a restart of this
    script too, and the master runs with --enable_offload=true and a 500 ms
    lease (docs/operating.md, "The SSD tier").
Logs go to $MOONCAKE_LOG_DIR; Ctrl-C (or SIGTERM) stops both. Matches
configs/single-node.json.

Environment (defaults in brackets):
  MOONCAKE_HOST           address every process binds and advertises [127.0.0.1]
  MOONCAKE_RPC_PORT       master RPC port [50051]
  MOONCAKE_METRICS_PORT   master /health, /metrics [9003]
  MOONCAKE_METADATA_PORT  embedded HTTP metadata server [8080]
  MOONCAKE_SEGMENT_SIZE   memory the storage node contributes, e.g. 4gb [4gb]
  MOONCAKE_LOG_DIR        log directory [./mooncake-logs]
  MOONCAKE_SSD_DIR        same as --ssd-dir
  MOONCAKE_SSD_SIZE       same as --ssd-size
  PYTHON                  interpreter with mooncake_span and the Mooncake wheel
TXT
}
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { usage; exit 0; }
mc_parse_ssd_args "$@"
mc_master_ssd_flags

HOST=${MOONCAKE_HOST:-127.0.0.1}
RPC_PORT=${MOONCAKE_RPC_PORT:-50051}
METRICS_PORT=${MOONCAKE_METRICS_PORT:-9003}
METADATA_PORT=${MOONCAKE_METADATA_PORT:-8080}
SEGMENT=${MOONCAKE_SEGMENT_SIZE:-4gb}
LOG_DIR=${MOONCAKE_LOG_DIR:-./mooncake-logs}
mkdir -p "$LOG_DIR"
export MC_TCP_BIND_ADDRESS=$HOST

pids=()
cleanup() {
  trap - EXIT INT TERM
  # Storage node first, so it can unregister while the master still answers.
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
}
trap cleanup EXIT INT TERM

"$(mc_bin mooncake_master)" \
  --rpc_port="$RPC_PORT" --rpc_address="$HOST" \
  --metrics_port="$METRICS_PORT" --metrics_host="$HOST" --logtostderr \
  --enable_http_metadata_server=true \
  --http_metadata_server_port="$METADATA_PORT" --http_metadata_server_host="$HOST" \
  "${MASTER_SSD_FLAGS[@]}" \
  >>"$LOG_DIR/master.log" 2>&1 &
pids+=($!)
mc_wait_http "http://$HOST:$METRICS_PORT/health" 30 '"service_ready":\s*true'

mc_node_ssd_flags node0 "http://$HOST:$METRICS_PORT"
"$(mc_python)" -m mooncake_span.storage_node \
  --master="$HOST:$RPC_PORT" --metadata="http://$HOST:$METADATA_PORT/metadata" \
  --segment-bytes="$SEGMENT" --host="$HOST" \
  "${NODE_SSD_FLAGS[@]}" \
  >>"$LOG_DIR/storage-node.log" 2>&1 &
pids+=($!)
deadline=$((SECONDS + 60))
until grep -q '^READY ' "$LOG_DIR/storage-node.log" 2>/dev/null; do
  kill -0 "${pids[1]}" 2>/dev/null || { echo "storage node died; see $LOG_DIR/storage-node.log" >&2; exit 1; }
  (( SECONDS < deadline )) || { echo "storage node not READY within 60s" >&2; exit 1; }
  sleep 0.1
done

cat <<TXT
mooncake is up (logs in $LOG_DIR)
  master_server_address: $HOST:$RPC_PORT
  metadata_server:       http://$HOST:$METADATA_PORT/metadata
  storage node:          $SEGMENT on $HOST
  SSD tier:              $(grep -o 'ssd_dir=[^ ]* ssd_cap_bytes=[0-9]*' "$LOG_DIR/storage-node.log" | tail -1 || echo none)
sglang: --hicache-storage-backend dynamic --hicache-storage-backend-extra-config @configs/single-node.json
Ctrl-C stops it.
TXT
wait -n "${pids[@]}"
echo "a Mooncake process exited; see $LOG_DIR" >&2
exit 1
