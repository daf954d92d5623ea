#!/usr/bin/env bash
# Idempotent set-up: a Python 3.12 virtual environment in .venv with wmrl installed (editable).
# Re-running is a no-op unless pyproject.toml changed. Override the interpreter with WMRL_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/find_python.sh

if ! PY=$(find_python); then
  echo "wmrl setup: Python 3.12 is required (lerobot 0.6 needs it) and was not found." >&2
  echo "  Install it (e.g. 'pyenv install 3.12') or point WMRL_PYTHON at a python3.12 binary, then re-run." >&2
  exit 1
fi

stamp=.venv/.wmrl-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "wmrl setup: .venv is up to date ($($PY --version))."
  exit 0
fi

echo "wmrl setup: creating .venv with $PY (first time takes about 3-5 minutes) ..."
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
if ! .venv/bin/python -m pip install --quiet --progress-bar off -e '.[sim,dev]' 2> >(grep -v -e "^WARNING: Location" -e "BuildBackendWarning" >&2); then
  echo "wmrl setup: pip install failed (see above)." >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "wmrl setup: done. Run 'source .venv/bin/activate' or call .venv/bin/wmrl directly."
