#!/usr/bin/env bash
# One-command development setup: Debian packages, .venv with pinned torch (CPU),
# sglang 0.5.23 (--no-deps + explicit list, with what a real server and
# sglang-router need), Mooncake, test tools, and this repository's two
# distributions in editable mode: the serving one (the root) and the tooling
# (tools/: benchmarks, lab, demos, test support). Re-running it is fast: pip
# steps are skipped while the requirement files are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/pip_quiet.sh
source scripts/lib/pip_quiet.sh

VENV=${MOONCAKE_SPAN_VENV:-.venv}
PY=${PYTHON:-python3.11}
APT_PACKAGES=(libibverbs1 librdmacm1 etcd-server iproute2 g++ ninja-build libssl-dev)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

stamp="$VENV/.mooncake-span-setup"
digest=$(cat requirements/*.txt pyproject.toml tools/pyproject.toml scripts/setup.sh scripts/lib/pip_quiet.sh \
  | sha256sum | cut -d' ' -f1)
if [[ "$(cat "$stamp" 2>/dev/null)" != "$digest" ]]; then
  echo "setup: installing Python packages into $VENV (first run takes a few minutes)"
  # torch first and pinned, so that nothing later can pull a CUDA build in.
  pip_quiet "${PIP[@]}" torch==2.13.0
  pip_quiet "${PIP[@]}" --no-deps sglang==0.5.23
  # The server stack (requirements/server-cpu.txt) is installed with torch held
  # at the CPU build: some of its packages accept any torch and would upgrade it.
  pip_quiet "${PIP[@]}" -c requirements/torch-cpu-constraint.txt \
    -r requirements/sglang-cpu.txt -r requirements/server-cpu.txt -r requirements/dev.txt
  pip_quiet "${PIP[@]}" --no-deps -e . -e tools
  echo "$digest" > "$stamp"
fi

# sglang imports torchvision at import time; PyPI only has CUDA builds of it.
# Install the import-only stand-in unless a working torchvision is present.
if ! "$VENV/bin/python" -c "import torchvision" >/dev/null 2>&1; then
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  rm -rf "$site/torchvision"
  cp -r tools/torchvision_stub/torchvision "$site/torchvision"
  echo "setup: installed the torchvision import-only stand-in into $site"
fi

"$VENV/bin/python" - <<'PY'
import torch
assert not torch.version.cuda, f"a CUDA torch was installed ({torch.__version__}); expected the CPU build"
import sglang.srt.mem_cache.hicache_storage  # noqa: F401
import sglang_router  # noqa: F401
import uvicorn  # noqa: F401
import mooncake.store  # noqa: F401
import mooncake_span  # noqa: F401
import mooncake_span_tools  # noqa: F401
print(f"setup: ok (torch {torch.__version__}, sglang + mooncake import)")
PY
