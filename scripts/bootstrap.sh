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

# Dawn, the second runtime (docs/runtimes.md), refuses Mesa's lavapipe before Mesa 25 (Debian 12 ships 22.3:
# "shaderUniform*ArrayDynamicIndexing required"). Where Dawn accepts no adapter and the installed lavapipe is
# older, install Mesa 25 from bookworm-backports on Debian 12. Never fails the bootstrap: without it the Dawn
# tests skip, saying why (`make test`'s second pass).
dawn_why() { "$VENV/bin/python" -m ddl_wgpu.runtime.gpu --check-dawn 2>/dev/null | tail -n 1; }
if ! "$VENV/bin/python" -m ddl_wgpu.runtime.gpu --check-dawn >/dev/null 2>&1; then
  mesa=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || true)
  codename=$( (. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}") || true)
  if [ -n "$mesa" ] && [ "${mesa%%.*}" -lt 25 ] 2>/dev/null && [ "$codename" = bookworm ] && as_root && have_apt; then
    src=/etc/apt/sources.list.d/backports.sources
    if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
      echo "bootstrap: Dawn refuses lavapipe of Mesa $mesa; adding bookworm-backports ($src) for Mesa 25"
      printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' >"$src"
    fi
    echo "bootstrap: apt-get install -y -t bookworm-backports mesa-vulkan-drivers"
    if DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers >/dev/null 2>&1; then
      echo "bootstrap: installed mesa-vulkan-drivers $(dpkg-query -W -f='${Version}' mesa-vulkan-drivers)"
    else
      echo "bootstrap: bookworm-backports is unavailable; the Dawn tests will skip ($(dawn_why))"
    fi
  else
    echo "bootstrap: Dawn cannot run here ($(dawn_why)); the Dawn tests will skip"
  fi
fi
