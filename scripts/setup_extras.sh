#!/usr/bin/env bash
# Installs the evaluation / reward / demo extras of mmspec into an existing venv (called by
# scripts/setup.sh after the core install; safe to re-run).
#
#   VENV=.venv bash scripts/setup_extras.sh
#
# What it installs: open_clip_torch, image-reward 1.5 (+ its undeclared `openai-clip` import, which
# needs setuptools<81 for pkg_resources), the timm that image-reward pins, torchvision, torchmetrics,
# torch-fidelity (the FID InceptionV3 network; weights from a local file), scipy, matplotlib,
# accelerate, gradio (>=5, pillow<13) and the playwright python package (no browsers: the UI test
# drives Debian's chromium).
#
# Every pip call passes requirements/constraints.txt, which pins torch==2.13.0: open_clip_torch and
# image-reward both pull torchvision, whose newest release would otherwise replace the CPU torch with a
# CUDA build and ~18 CUDA packages.
#
# torchvision on a CPU torch: the only torchvision built for torch 2.13.0 is a CUDA wheel. On the CPU
# torch its C++ extension does not load, and `import torchvision` then dies registering fake kernels of
# the missing `torchvision::nms`/`qnms` operators (which also breaks `import transformers` model
# classes, since they probe torchvision). When, and only when, that happens here, this script installs
# a small startup hook into the venv (a .pth file plus a module) that defines those two operator schemas
# just before torchvision is first imported. torchvision's transforms and models then work;
# torchvision.ops (nms, roi_align) still raises its own "Couldn't load custom C++ ops" error. The
# workaround lives in the environment only: no mmspec code path depends on it, and on a normal CUDA
# install of torch the hook is not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="$VENV/bin/python"
CONSTRAINTS="requirements/constraints.txt"
PIP=("$PYTHON" -m pip --disable-pip-version-check)
export PIP_PROGRESS_BAR=off

if [ ! -x "$PYTHON" ]; then
    echo "setup_extras.sh: no python at $PYTHON (set VENV to an existing virtual environment)" >&2
    exit 1
fi

# 1. The extras, in one resolver run so the pins below are solved together.
"${PIP[@]}" install -q -c "$CONSTRAINTS" \
    "setuptools>=68,<81" \
    torchvision \
    "open_clip_torch" \
    "image-reward==1.5" \
    "openai-clip" \
    torchmetrics \
    torch-fidelity \
    scipy \
    matplotlib \
    accelerate \
    "gradio>=5" \
    "pillow<13" \
    playwright

# 2. torchvision on a CPU torch (see the header): install the import hook only when it is needed.
SITE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
HOOK_MODULE="$SITE/_mmspec_torchvision_cpu_hook.py"
HOOK_PTH="$SITE/_mmspec_torchvision_cpu_hook.pth"
rm -f "$HOOK_MODULE" "$HOOK_PTH"
if ! "$PYTHON" -c "import torchvision" >/dev/null 2>&1; then
    cat > "$HOOK_MODULE" <<'PY'
"""Environment workaround installed by mmspec's scripts/setup_extras.sh (not part of mmspec).

The torchvision wheel matching this torch is a CUDA build; on the CPU torch its C++ extension fails to
load and `import torchvision` then dies with "operator torchvision::nms does not exist" while
registering fake kernels. This hook waits for the first lookup of `torchvision`, tries to load its
extension, and only if that fails defines the schemas of torchvision::nms and torchvision::qnms so the
import succeeds. torchvision.ops stays unavailable (it raises its own clear error).
"""

import importlib.abc
import importlib.machinery
import os
import sys


class _TorchvisionCpuHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)  # one shot
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.submodule_search_locations:
            return None
        try:
            import torch

            extension = os.path.join(list(spec.submodule_search_locations)[0], "_C.so")
            try:
                torch.ops.load_library(extension)
                return None  # the extension loads: nothing to work around
            except (OSError, ImportError):
                pass
            for name in ("nms", "qnms"):
                if not hasattr(torch.ops.torchvision, name):
                    torch.library.define(
                        f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
                    )
        except Exception:  # never break interpreter start-up or unrelated imports
            pass
        return None


sys.meta_path.insert(0, _TorchvisionCpuHook())
PY
    echo "import _mmspec_torchvision_cpu_hook" > "$HOOK_PTH"
    echo "setup_extras.sh: installed the torchvision CPU import hook ($HOOK_PTH)"
fi

# 3. Checks: torch untouched, and everything the extras provide imports.
"$PYTHON" - <<'PY'
import torch

assert torch.__version__.startswith("2.13.0"), f"torch was replaced: {torch.__version__}"
import transformers  # noqa: F401
from transformers import CLIPModel, LlamaForCausalLM  # noqa: F401  (model classes probe torchvision)
import diffusers  # noqa: F401
from diffusers import DiffusionPipeline  # noqa: F401
import torchvision  # noqa: F401
import open_clip  # noqa: F401
import torchmetrics  # noqa: F401
import torch_fidelity  # noqa: F401
import scipy  # noqa: F401
import matplotlib  # noqa: F401
import accelerate  # noqa: F401
import gradio  # noqa: F401
import playwright  # noqa: F401
import warnings

with warnings.catch_warnings():  # openai-clip warns that pkg_resources is deprecated
    warnings.simplefilter("ignore")
    import clip  # noqa: F401
print(f"mmspec extras ready: torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"open_clip {open_clip.__version__}")
PY
