# Shared helpers for the Mooncake launcher scripts (sourced, not run).
# shellcheck shell=bash

# The Python that has mooncake_span and the Mooncake wheel: $PYTHON, else the
# repository's .venv, else python3 on PATH.
mc_python() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
  local repo_venv
  repo_venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python"
  if [[ -x "$repo_venv" ]]; then echo "$repo_venv"; else echo python3; fi
}

# An executable next to that Python (the wheel installs mooncake_master
# there), else on PATH.
mc_bin() {
  local name=$1 beside
  beside="$(dirname "$(command -v "$(mc_python)")")/$name"
  if [[ -x "$beside" ]]; then echo "$beside"; return; fi
  command -v "$name" || { echo "error: $name not found next to $(mc_python) or on PATH" >&2; exit 1; }
}

# mc_wait_http URL TIMEOUT_S PATTERN: poll URL until its body contains
# PATTERN (a Python regex), at most TIMEOUT_S seconds.
mc_wait_http() {
  "$(mc_python)" - "$1" "$2" "$3" <<'PY'
import re, sys, time, urllib.request
url, timeout_s, pattern = sys.argv[1], float(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + timeout_s
while True:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            if re.search(pattern, r.read().decode(errors="replace")):
                sys.exit(0)
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"{url} did not answer /{pattern}/ within {timeout_s:.0f}s")
    time.sleep(0.1)
PY
}

mc_require() {
  local name=$1
  if [[ -z "${!name:-}" ]]; then
    echo "error: set $name (see --help)" >&2
    exit 2
  fi
}

# mc_parse_ssd_args ARGS...: the SSD-tier flags every launcher takes.
#   --ssd-dir DIR    storage node: keep every object on DIR/<node name> too
#   --ssd-size SIZE  storage node: disk cap of that tier [90% of the disk]
#   --ssd            master: accept SSD-tier storage nodes (implied by --ssd-dir)
# Sets SSD_DIR, SSD_SIZE (from MOONCAKE_SSD_DIR / MOONCAKE_SSD_SIZE unless
# given) and SSD (1 when the master must run with --enable_offload).
mc_parse_ssd_args() {
  SSD_DIR=${MOONCAKE_SSD_DIR:-}
  SSD_SIZE=${MOONCAKE_SSD_SIZE:-}
  SSD=${MOONCAKE_SSD:-0}
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --ssd-dir) [[ $# -ge 2 ]] || { echo "error: --ssd-dir needs a directory" >&2; exit 2; }
                 SSD_DIR=$2; shift 2 ;;
      --ssd-dir=*) SSD_DIR=${1#*=}; shift ;;
      --ssd-size) [[ $# -ge 2 ]] || { echo "error: --ssd-size needs a size" >&2; exit 2; }
                  SSD_SIZE=$2; shift 2 ;;
      --ssd-size=*) SSD_SIZE=${1#*=}; shift ;;
      --ssd) SSD=1; shift ;;
      *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
  done
  if [[ -n "$SSD_SIZE" && -z "$SSD_DIR" ]]; then
    echo "error: --ssd-size needs --ssd-dir" >&2; exit 2
  fi
  [[ -n "$SSD_DIR" ]] && SSD=1
  return 0
}

# MASTER_SSD_FLAGS: the master flags an SSD tier needs: offload on, a lease
# short enough for eviction to free offloaded copies, and DRAM headroom for
# write bursts (docs/operating.md, "The SSD tier").
mc_master_ssd_flags() {
  MASTER_SSD_FLAGS=()
  if [[ "${SSD:-0}" == 1 ]]; then
    MASTER_SSD_FLAGS=(--enable_offload=true --default_kv_lease_ttl=500
      --eviction_high_watermark_ratio=0.7 --eviction_ratio=0.2)
  fi
}

# mc_node_ssd_flags NAME [ADMIN_URL]: NODE_SSD_FLAGS, the storage node's SSD
# flags (none without --ssd-dir). ADMIN_URL lets a restart after a crash wait
# only until the master dropped its predecessor (else the whole client TTL).
mc_node_ssd_flags() {
  NODE_SSD_FLAGS=()
  [[ -n "${SSD_DIR:-}" ]] || return 0
  NODE_SSD_FLAGS=(--ssd-dir="$SSD_DIR" --node-name="$1")
  [[ -n "${2:-}" ]] && NODE_SSD_FLAGS+=(--admin-url="$2")
  [[ -n "$SSD_SIZE" ]] && NODE_SSD_FLAGS+=(--ssd-size="$SSD_SIZE")
  return 0
}
