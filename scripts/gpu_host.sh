#!/usr/bin/env bash
# Run mmspec commands (training recipes, benchmarks, tests) on a GPU host that has a CUDA build of torch
# and transformers but no network and no mmspec environment, e.g. a lent or rented GPU machine that only
# receives a copy of this repository.
#
#   here, with a package index:   bash scripts/gpu_host.sh --download [PYTHON_VERSION]   (default 3.12)
#       downloads the wheels the host lacks into .whl/ (git-ignored; MMSPEC_GPU_WHEELS overrides the list)
#   on the GPU host, repo root:   bash scripts/gpu_host.sh python -m mmspec.models.recipes.train_mar ... --device cuda
#
# On the host the first call installs .whl/*.whl and mmspec itself (a regular, non-editable install, so
# pipelines/, models/ ... become mmspec.pipelines, mmspec.models ...) into MMSPEC_SITE (default
# /tmp/mmspec_site) without touching the host's packages; every call then runs the command from the
# repository root with that folder first on the path. PYTHONSAFEPATH=1 keeps the root's own mmspec/
# folder (the core alone) from shadowing the installed package, so relative paths (runs/, models/zoo/)
# work as in the docs. Recipes resume from their --work folder; --time-limit fits a run to a lease.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
WHEELS="$ROOT/.whl"

if [ "${1:-}" = "--download" ]; then
    version="${2:-3.12}"
    read -r -a packages <<< "${MMSPEC_GPU_WHEELS:-diffusers==0.42.1 einops==0.8.2 importlib_metadata zipp}"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$WHEELS" "${packages[@]}"
    echo "gpu_host: wheels for Python $version in $WHEELS:"
    ls -1 "$WHEELS"
    exit 0
fi
if [ "$#" -eq 0 ]; then
    echo "usage: bash scripts/gpu_host.sh --download [PYTHON_VERSION] | COMMAND [ARGS...]" >&2
    exit 2
fi

PYTHON="${PYTHON:-python3}"
SITE="${MMSPEC_SITE:-/tmp/mmspec_site}"
"$PYTHON" -c "import torch, transformers" 2>/dev/null || {
    echo "gpu_host: $PYTHON lacks torch or transformers; add their wheels to .whl/" >&2; exit 1; }
if [ ! -f "$SITE/.wheels-installed" ]; then  # the dependency wheels once per host
    mkdir -p "$SITE"
    if compgen -G "$WHEELS/*.whl" > /dev/null; then
        "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
    fi
    touch "$SITE/.wheels-installed"
fi
# mmspec itself on every call (a few seconds), so the installed copy is this tree's; a caller that starts
# several commands at once installs first and sets MMSPEC_SITE_READY=1 for them (concurrent builds share
# the tree's build/ folder and fail).
if [ "${MMSPEC_SITE_READY:-0}" != 1 ]; then
    rm -rf "$SITE"/mmspec "$SITE"/mmspec-*.dist-info
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-build-isolation --target "$SITE" "$ROOT"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PYTHON" -c "import mmspec, sys; sys.exit(0 if mmspec.__file__.startswith('$SITE') else 1)" || {
    echo "gpu_host: mmspec does not import from $SITE" >&2; exit 1; }
exec "$@"
