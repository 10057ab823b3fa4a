#!/usr/bin/env bash
# Build the wheel, install it (without dependencies: they are the environment's) into a scratch folder and
# check that one call per pipeline on the zoo gives exactly what the checkout gives (scripts/wheel_smoke.py).
# Both runs use the set-up's interpreter from a folder outside the checkout, so the wheel's run imports
# mmspec from the wheel only (the script checks where mmspec was imported from).
#
# Usage: bash scripts/wheel_smoke.sh     (after bash scripts/setup.sh; offline; about 2 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="$ROOT/${MMSPEC_VENV:-.venv}/bin/python"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# build from a copy of the files git tracks or would track (deleted ones skipped): a stale build/ folder never
# leaks into the wheel
mkdir -p "$SCRATCH/src"
git ls-files -z --cached --others --exclude-standard | tar -c --null --ignore-failed-read --warning=no-failed-read -T - -f - | tar -x -C "$SCRATCH/src"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$SCRATCH/dist" "$SCRATCH/src" > "$SCRATCH/build.log" 2>&1 \
    || { cat "$SCRATCH/build.log"; exit 1; }
WHEEL="$(ls "$SCRATCH"/dist/mmspec-*.whl)"
echo "built $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
"$PY" -m pip install -q --no-deps --target "$SCRATCH/site" "$WHEEL"

cd "$SCRATCH"
"$PY" "$ROOT/scripts/wheel_smoke.py" > checkout.json
PYTHONPATH="$SCRATCH/site" "$PY" "$ROOT/scripts/wheel_smoke.py" > wheel.json
PYTHONPATH="$SCRATCH/site" "$PY" -m mmspec.cli --version
"$PY" - "$ROOT" "$SCRATCH" <<'PY'
import json, sys
root, scratch = sys.argv[1], sys.argv[2]
checkout, wheel = (json.load(open(f"{scratch}/{name}.json")) for name in ("checkout", "wheel"))
assert checkout.pop("mmspec_file").startswith(root), "the checkout run did not import the checkout"
where = wheel.pop("mmspec_file")
assert where.startswith(f"{scratch}/site/"), f"the wheel run imported mmspec from {where}, not the wheel"
differ = [name for name in checkout if checkout[name] != wheel[name]]
assert not differ, f"the wheel decodes differently from the checkout for: {differ}\n{checkout}\n{wheel}"
print(f"wheel smoke test passed: {', '.join(checkout)} equal to the checkout")
print(f"  vlm answer: {checkout['vlm']['text'][:80]}...")
PY
