#!/usr/bin/env bash
# One-command set-up on a fresh machine: creates .venv and installs mmspec with pinned dependencies.
#
# torch is installed first at exactly 2.13.0 (the local CPU wheel on our machines, the PyPI wheel
# elsewhere) and every later pip call gets requirements/constraints.txt, which pins it, so no
# dependency can replace torch or pull CUDA packages: the torch installed first is the one every later step uses.
#
# Usage: bash scripts/setup.sh            (idempotent; re-running only installs what changed)
#        MMSPEC_VENV=/path bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MMSPEC_VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
export PIP_PROGRESS_BAR=off

"${PIP[@]}" install -q --upgrade "pip>=24" "setuptools>=68,<81" wheel
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
    "${PIP[@]}" install -q "torch==2.13.0"
fi

# Core, kernels (triton) and test tools.
"${PIP[@]}" install -q -c requirements/constraints.txt -e ".[dev,kernels]"

# --- evaluation / reward / demo extras -------------------------------------------------------
if [ -f scripts/setup_extras.sh ]; then
    VENV="$VENV" bash scripts/setup_extras.sh
fi

"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"torch was replaced: {torch.__version__}"
import mmspec  # noqa: F401
print(f"mmspec environment ready: torch {torch.__version__}")
PY
