#!/usr/bin/env bash
# README command (b): set up (idempotent) and run the tests. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MUJOCO_GL="${MUJOCO_GL:-egl}" HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q --durations=25 "$@"
