# Sourced by scripts/setup.sh and scripts/setup_libero.sh: find_python prints a Python 3.12
# interpreter (WMRL_PYTHON first, then PATH, pyenv and the usual prefixes) or returns 1.
find_python() {
  local c
  for c in "${WMRL_PYTHON:-}" python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    c=$(pyenv root)/versions/$(pyenv versions --bare | grep -E '^3\.12(\.|$)' | tail -n1)/bin/python3.12
    [ -x "$c" ] && { echo "$c"; return 0; }
  fi
  return 1
}
