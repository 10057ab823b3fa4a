#!/usr/bin/env bash
# Build the mmspec/shapes-t2i zoo entry (docs/pipeline_ar_image.md): target, EAGLE head, MuLo-SD
# drafter + up-sampler, pipeline folder, quality report. Every step is deterministic and resumable:
# rerun the script to continue after an interruption (finished steps return at once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ZOO=models/zoo/shapes-t2i
export HF_HUB_OFFLINE=1
$PY -m mmspec.models.recipes.train_t2i --out $ZOO/transformer
$PY -m mmspec.models.recipes.train_eagle --target $ZOO/transformer --out $ZOO/eagle_head
$PY -m mmspec.models.recipes.train_mulo --out $ZOO
$PY -m mmspec.models.recipes.build_zoo_t2i --folder $ZOO
$PY -m mmspec.models.recipes.report_t2i --model $ZOO/transformer --out $ZOO/report.json
