#!/usr/bin/env bash
# One-command test run: sets up the environment (scripts/setup.sh) and runs the test suite offline.
#
#   bash scripts/test.sh              default suite (under 10 minutes on 2 CPU cores)
#   bash scripts/test.sh --slow       only the slow checks (marker `slow`)
#   bash scripts/test.sh --all        both
# Extra arguments after these flags go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MMSPEC_VENV:-.venv}"
bash scripts/setup.sh
# Headless Chromium for the demo's browser test (apt-get when missing; never fails the run: without a
# browser the test is skipped and says why).
bash scripts/setup_browser.sh

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
# TRITON_INTERPRET: tests/conftest.py sets it to 1 when torch sees no GPU (Triton kernels run on the CPU
# through the interpreter); with a GPU the kernels run compiled.
export GRADIO_ANALYTICS_ENABLED=False
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"  # a run without workers; each worker gets one (below)

selection=(-m "not slow")
case "${1:-}" in
    --slow) selection=(-m slow); shift ;;
    --all) selection=(); shift ;;
esac
if [ "${#selection[@]}" -eq 0 ] || [ "${selection[1]}" = "slow" ]; then
    # the slow checks include the real model's conversion (the `real` extra: the gguf reader)
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -e ".[real]"
fi
# Tests run in pytest-xdist workers (work stealing, one torch thread each): one per CPU core, at most 4.
# MMSPEC_TEST_WORKERS=N sets the number; 1 runs everything in this process.
cores="$(nproc 2>/dev/null || echo 1)"
workers="${MMSPEC_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
parallel=()
if [ "$workers" -gt 1 ]; then
    parallel=(-n "$workers" --dist worksteal)
    export OMP_NUM_THREADS=1
fi
exec "$VENV/bin/python" -m pytest "${parallel[@]}" "${selection[@]}" "$@"
