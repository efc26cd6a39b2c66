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
