#!/usr/bin/env bash
# Make `.venv` (the package installed editable with the extras named in $EXTRAS) and make sure a Vulkan,
# Metal or DX12 adapter exists. Called by every Makefile target, so `make demo` and `make test` work on a
# fresh Debian/Ubuntu machine that has only python3 (and apt, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test,plot}
VENV=.venv

as_root() { [ "$(id -u)" = 0 ]; }
have_apt() { command -v apt-get >/dev/null 2>&1; }
apt_install() {
  echo "bootstrap: apt-get install -y $*"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PY" -m venv "$VENV" >/dev/null 2>&1; then
    rm -rf "$VENV"
    if as_root && have_apt; then
      apt_install python3-venv
      "$PY" -m venv "$VENV"
    else
      echo "bootstrap: cannot create a virtual environment; run: sudo apt-get install -y python3-venv" >&2
      exit 1
    fi
  fi
fi

# Reinstall only when pyproject.toml or the extras changed.
stamp="$VENV/.installed-$( (cat pyproject.toml; echo "$EXTRAS") | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "bootstrap: installing ddl-wgpu[$EXTRAS] into $VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi

# A real (non-OpenGL) adapter: Vulkan, Metal or DX12.
has_adapter() { "$VENV/bin/python" -m ddl_wgpu.runtime.gpu --check >/dev/null 2>&1; }
if ! has_adapter; then
  if as_root && have_apt; then
    apt_install mesa-vulkan-drivers
    has_adapter || { echo "bootstrap: still no Vulkan adapter after installing mesa-vulkan-drivers" >&2; exit 1; }
  else
    echo "bootstrap: no Vulkan/Metal/DX12 adapter found; run: sudo apt-get install -y mesa-vulkan-drivers" >&2
    exit 1
  fi
fi
