# shellcheck shell=bash
# pip_quiet CMD...: run a pip install command; pass its errors through, but
# replace the resolver's list of sglang requirements with one line. sglang is
# installed with --no-deps and only its CPU subset (requirements/sglang-cpu.txt)
# follows, so pip names the skipped CUDA/serving packages after every install.
# Conflicts of any other package still print in full.

_PIP_RESOLVER_HEADER="^ERROR: pip's dependency resolver does not currently take into account"
_PIP_SGLANG_LINE="^sglang [0-9][^ ]* (requires|has requirement) "

# filter_pip_stderr FILE: print FILE without the expected lines; say how many went.
filter_pip_stderr() {
  local file=$1 expected others
  expected=$(grep -cE "$_PIP_SGLANG_LINE" "$file" || true)
  # Conflict lines: "<dist> <version> requires|has requirement ...", not sglang's.
  others=$(grep -E "^[A-Za-z0-9_.-]+ [0-9][^ ]* (requires|has requirement) " "$file" \
    | grep -cvE "$_PIP_SGLANG_LINE" || true)
  if ((others > 0)); then
    grep -vE "$_PIP_SGLANG_LINE" "$file" || true
  else
    grep -vE "$_PIP_RESOLVER_HEADER|$_PIP_SGLANG_LINE" "$file" || true
  fi
  if ((expected > 0)); then
    echo "setup: pip lists $expected sglang requirements as missing or different: expected," \
      "sglang is installed --no-deps with only the CPU subset in requirements/sglang-cpu.txt"
  fi
}

pip_quiet() {
  local log rc=0
  log=$(mktemp)
  "$@" 2>"$log" || rc=$?
  filter_pip_stderr "$log" >&2
  rm -f "$log"
  return "$rc"
}
