#!/usr/bin/env bash
# Multi-host Mooncake topology on one machine (network namespaces); a thin
# wrapper over `python -m mooncake_span_tools.lab.netns`.
set -euo pipefail
source "$(dirname "$0")/_mooncake_common.sh"

usage() {
  cat <<'TXT'
usage: scripts/netns_cluster.sh up [--ha] [--oplog] [--no-etcd] [--segment-size SIZE] [--detach] [--log-dir DIR]
       scripts/netns_cluster.sh list
       scripts/netns_cluster.sh exec RUN_ID HOST -- COMMAND...
       scripts/netns_cluster.sh down RUN_ID | --stale

Creates hosts master, store1, store2, prefill, decode (plus master2 with --ha)
as network namespaces joined by a bridge that lives in its own namespace
(addresses 198.18.0.1-6/24; the machine's own interfaces are not touched), and
starts Mooncake on them: mooncake_master with its HTTP metadata server and
an etcd (for span_layout_guard=etcd) on master, or with --ha two HA masters
(master, master2) whose election and metadata use that etcd; a storage node
on store1 and on store2. `up` stays in the foreground until Ctrl-C unless --detach is given;
`exec` runs a command on a host with MC_TCP_BIND_ADDRESS and
MOONCAKE_LOCAL_HOSTNAME set to its address; `down` stops a run's processes and
deletes its namespaces (--stale: every run whose owner process died).

Needs root and iproute2.

Environment:
  PYTHON                        interpreter with mooncake_span (default: ./.venv/bin/python, then python3)
  MOONCAKE_SPAN_NETNS_STATE_DIR where run state is kept (default /run/mooncake-span-netns)
TXT
}

case "${1:-}" in
  ""|-h|--help) usage; exit 0 ;;
esac
exec "$(mc_python)" -m mooncake_span_tools.lab.netns "$@"
