#!/usr/bin/env bash
# Build the mmspec/shapes-vlm zoo entry (docs/pipeline_vlm.md): the shapes captioner (target), its
# standalone draft VLM, the four draft heads (online distillation from the frozen captioner), then the
# pipeline folder and the accuracy report. Every step is deterministic and resumable: rerun the script to
# continue after an interruption (finished steps return at once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ZOO=models/zoo/shapes-vlm
export HF_HUB_OFFLINE=1
[ -f $ZOO/model_index.json ] && { echo "$ZOO is already assembled (delete it to rebuild)"; exit 0; }
$PY -m mmspec.models.recipes.train_vlm --size target --out runs/train_vlm_target/model
# a second cosine schedule to step 4000 (resumes runs/train_vlm_target at step 2000): describe 65.7 % -> 77.5 %
$PY -m mmspec.models.recipes.train_vlm --size target --steps 4000 --out runs/train_vlm_target/model
# a third stage from that captioner on a mix enriched in shared colours and look-alike objects, then a short
# fourth one on a mix closer to the world's own (docs/zoo_shapes_vlm.md): describe 77.5 % -> 82.8 % -> 88.3 %
$PY -m mmspec.models.recipes.train_vlm --size target --init runs/train_vlm_target/model --duplicate-fraction 0.5 \
    --lr 5e-4 --seed 1 --steps 1800 --aux-weight 0 --work runs/train_vlm_target_dup --out runs/train_vlm_target_dup/model
$PY -m mmspec.models.recipes.train_vlm --size target --init runs/train_vlm_target_dup/model --duplicate-fraction 0.15 \
    --lr 2e-4 --seed 2 --steps 600 --aux-weight 0 --work runs/train_vlm_target_dup2 --out $ZOO/target
$PY -m mmspec.models.recipes.train_vlm --size draft --out $ZOO/draft
# the four heads in one run: each step's teacher forward (most of a step's cost) serves all of them
$PY -m mmspec.models.recipes.train_vlm_drafter --method eagle flash vispec specvlm --target $ZOO/target \
    --out $ZOO --work runs/train_vlm_heads
$PY -m mmspec.models.recipes.report_vlm --model $ZOO/target --draft $ZOO/draft --out $ZOO/report.json
$PY -m mmspec.models.recipes.build_zoo_vlm --folder $ZOO
