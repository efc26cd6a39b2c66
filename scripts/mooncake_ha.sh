#!/usr/bin/env bash
# Mooncake with HA masters: etcd elects the leader; clients and storage nodes
# find it through etcd, so a master can die without reconfiguring anyone.
set -euo pipefail
source "$(dirname "$0")/_mooncake_common.sh"

usage() {
  cat <<'TXT'
usage: scripts/mooncake_ha.sh etcd|master|storage [--ssd | --ssd-dir DIR [--ssd-size SIZE]] [--help]

Roles (run each on its own host, in the foreground):
  etcd     etcd (leader election, transfer metadata, layout guard)
  master   a mooncake_master in HA mode with --enable_oplog=true, so keys
           survive a failover; run it on two or more hosts
  storage  a storage node; master and metadata are both etcd://

Matches configs/ha-etcd.json. A failover takes ~10 s; during it backend calls
answer misses. Without --enable_oplog (MOONCAKE_OPLOG=false) the new leader
starts empty and the cache is lost (the bytes stay unreachable on the nodes).

Environment (defaults in brackets):
  MOONCAKE_HOST             this host's address; every process binds it (required)
  MOONCAKE_ETCD             etcd HOST:PORT (required for master and storage)
  MOONCAKE_OPLOG            master: true|false [true]
  MOONCAKE_RPC_PORT         master: RPC port [50051]
  MOONCAKE_METRICS_PORT     master: /health, /metrics [9003]
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
  etcd|master|storage) ;;
  *) usage >&2; exit 2 ;;
esac
shift
mc_parse_ssd_args "$@"
mc_master_ssd_flags
mc_require MOONCAKE_HOST
export MC_TCP_BIND_ADDRESS=$MOONCAKE_HOST

case "$role" in
  etcd)
    client="http://$MOONCAKE_HOST:${MOONCAKE_ETCD_CLIENT_PORT:-2379}"
    peer="http://$MOONCAKE_HOST:${MOONCAKE_ETCD_PEER_PORT:-2380}"
    exec "$(mc_bin etcd)" --name=mooncake-span --data-dir="${MOONCAKE_ETCD_DATA_DIR:-./etcd-data}" \
      --listen-client-urls="$client" --advertise-client-urls="$client" \
      --listen-peer-urls="$peer" --initial-advertise-peer-urls="$peer" \
      --initial-cluster="mooncake-span=$peer" --initial-cluster-state=new
    ;;
  master)
    mc_require MOONCAKE_ETCD
    oplog=()
    [[ "${MOONCAKE_OPLOG:-true}" == true ]] && oplog=(--enable_oplog=true)
    exec "$(mc_bin mooncake_master)" \
      --rpc_port="${MOONCAKE_RPC_PORT:-50051}" --rpc_address="$MOONCAKE_HOST" \
      --metrics_port="${MOONCAKE_METRICS_PORT:-9003}" --metrics_host="$MOONCAKE_HOST" --logtostderr \
      --enable_ha=true --ha_backend_type=etcd --ha_backend_connstring="$MOONCAKE_ETCD" \
      "${oplog[@]}" "${MASTER_SSD_FLAGS[@]}"
    ;;
  storage)
    mc_require MOONCAKE_ETCD
    mc_node_ssd_flags "$(hostname)"
    exec "$(mc_python)" -m mooncake_span.storage_node \
      --master="etcd://$MOONCAKE_ETCD" --metadata="etcd://$MOONCAKE_ETCD" \
      --segment-bytes="${MOONCAKE_SEGMENT_SIZE:-4gb}" --host="$MOONCAKE_HOST" \
      "${NODE_SSD_FLAGS[@]}"
    ;;
esac
