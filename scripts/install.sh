#!/usr/bin/env bash
# Create .venv with Python >= 3.12 and install twinkle into it.
#   bash scripts/install.sh         # the library and the `twinkle` command
#   bash scripts/install.sh test    # plus the test tools (pytest, hypothesis, ruff, ray)
# torch is installed first and pinned so pip does not pull a different multi-GB build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

find_python() {
  for py in python3.12 python3.13 python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$py"; return
    fi
  done
  # pyenv's shims answer `command -v` even when the version is not selected: ask pyenv directly,
  # preferring 3.12 (the version CI and the GPU machines run).
  if command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare | grep -E '^3\.1[2-9](\.[0-9]+)?$' | sort -V | head -n 1)
    if [ -n "$v" ]; then echo "$(pyenv root)/versions/$v/bin/python"; return; fi
  fi
  echo "twinkle needs Python >= 3.12 (megatron-core >= 0.17 requires it); none found" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[$extras]"
else
  .venv/bin/python -m pip install -q -e .
fi
