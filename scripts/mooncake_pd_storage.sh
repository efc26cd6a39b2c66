#!/usr/bin/env bash
# Mooncake for prefill and decode nodes on different hosts: run one role per
# host (master host, storage hosts); sglang nodes are pure clients.
set -euo pipefail
source "$(dirname "$0")/_mooncake_common.sh"

usage() {
  cat <<'TXT'
usage: scripts/mooncake_pd_storage.sh master|storage|etcd [--ssd | --ssd-dir DIR [--ssd-size SIZE]] [--help]

Roles (run each on its own host, in the foreground):
  master   mooncake_master with its embedded HTTP metadata server
  etcd     etcd for the cluster-wide layout guard (span_layout_guard=etcd);
           optional, may run on the master host
  storage  a storage node: contributes MOONCAKE_SEGMENT_SIZE of memory; the
           cache lives here and survives restarts of every sglang node

Matches configs/prefill-decode.json (prefill and decode nodes set
MC_TCP_BIND_ADDRESS and MOONCAKE_LOCAL_HOSTNAME to their own address).

Environment (defaults in brackets):
  MOONCAKE_HOST             this host's address; every process binds it (required)
  MOONCAKE_MASTER           storage: the master's HOST:PORT (required)
  MOONCAKE_METADATA         storage: metadata URL [http://<master host>:8080/metadata]
  MOONCAKE_RPC_PORT         master: RPC port [50051]
  MOONCAKE_METRICS_PORT     master: /health, /metrics [9003]
  MOONCAKE_METADATA_PORT    master: HTTP metadata port [8080]
  MOONCAKE_SEGMENT_SIZE     storage: memory contributed [4gb]
  MOONCAKE_ETCD_CLIENT_PORT etcd: client port [2379]
  MOONCAKE_ETCD_PEER_PORT   etcd: peer port [2380]
  MOONCAKE_ETCD_DATA_DIR    etcd: data directory [./etcd-data]
  MOONCAKE_SSD_DIR          storage: same as --ssd-dir
  MOONCAKE_SSD_SIZE         storage: same as --ssd-size
  PYTHON                    interpreter with mooncake_span and the Mooncake wheel

SSD tier (docs/operating.md, "The SSD tier"): start the master with --ssd
(--enable_offload=true, 500 ms lease) and each storage node with --ssd-dir DIR
(an existing directory; the node uses DIR/<its host name>) and optionally
--ssd-size SIZE (disk cap, default 90% of the disk).
TXT
}
role=${1:-}
case "$role" in
  ""|-h|--help) usage; exit 0 ;;
  master|storage|etcd) ;;
  *) usage >&2; exit 2 ;;
esac
shift
mc_parse_ssd_args "$@"
mc_master_ssd_flags
mc_require MOONCAKE_HOST
export MC_TCP_BIND_ADDRESS=$MOONCAKE_HOST

case "$role" in
  master)
    exec "$(mc_bin mooncake_master)" \
      --rpc_port="${MOONCAKE_RPC_PORT:-50051}" --rpc_address="$MOONCAKE_HOST" \
      --metrics_port="${MOONCAKE_METRICS_PORT:-9003}" --metrics_host="$MOONCAKE_HOST" --logtostderr \
      --enable_http_metadata_server=true \
      --http_metadata_server_port="${MOONCAKE_METADATA_PORT:-8080}" \
      --http_metadata_server_host="$MOONCAKE_HOST" \
      "${MASTER_SSD_FLAGS[@]}"
    ;;
  etcd)
    client="http://$MOONCAKE_HOST:${MOONCAKE_ETCD_CLIENT_PORT:-2379}"
    peer="http://$MOONCAKE_HOST:${MOONCAKE_ETCD_PEER_PORT:-2380}"
    exec "$(mc_bin etcd)" --name=mooncake-span --data-dir="${MOONCAKE_ETCD_DATA_DIR:-./etcd-data}" \
      --listen-client-urls="$client" --advertise-client-urls="$client" \
      --listen-peer-urls="$peer" --initial-advertise-peer-urls="$peer" \
      --initial-cluster="mooncake-span=$peer" --initial-cluster-state=new
    ;;
  storage)
    mc_require MOONCAKE_MASTER
    master_host=${MOONCAKE_MASTER%:*}
    mc_node_ssd_flags "$(hostname)" "http://$master_host:${MOONCAKE_METRICS_PORT:-9003}"
    exec "$(mc_python)" -m mooncake_span.storage_node \
      --master="$MOONCAKE_MASTER" \
      --metadata="${MOONCAKE_METADATA:-http://$master_host:8080/metadata}" \
      --segment-bytes="${MOONCAKE_SEGMENT_SIZE:-4gb}" --host="$MOONCAKE_HOST" \
      "${NODE_SSD_FLAGS[@]}"
    ;;
esac
