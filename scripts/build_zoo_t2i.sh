#!/usr/bin/env bash
# Build the mmspec/shapes-t2i zoo entry (docs/pipeline_ar_image.md): target, EAGLE head, MuLo-SD
# drafter + up-sampler, pipeline folder, quality report. Every step is deterministic and resumable:
# rerun the script to continue after an interruption (finished steps return at once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ZOO=models/zoo/shapes-t2i
export HF_HUB_OFFLINE=1
$PY -m mmspec.models.recipes.train_t2i --out runs/train_t2i/model
# two later stages from that target, each on a newly rendered training set with a fresh cosine schedule
# (docs/pipeline_ar_image.md): GenEval-shapes at temperature 1 0.748 -> 0.785 -> 0.833 (greedy 0.717 -> 0.850)
$PY -m mmspec.models.recipes.train_t2i --init runs/train_t2i/model --seed 1 --lr 5e-4 --steps 1500 --threads 1 \
    --work runs/train_t2i_stage2 --out runs/train_t2i_stage2/model
$PY -m mmspec.models.recipes.train_t2i --init runs/train_t2i_stage2/model --seed 2 --lr 3e-4 --steps 1500 --threads 1 \
    --work runs/train_t2i_stage3 --out $ZOO/transformer
$PY -m mmspec.models.recipes.train_eagle --target $ZOO/transformer --out runs/train_eagle/head --threads 1
# stage 2 of the head on a newly rendered set (held-out top-1 agreement 0.870 on its seed-1 split)
$PY -m mmspec.models.recipes.train_eagle --target $ZOO/transformer --init runs/train_eagle/head --steps 2000 \
    --batch 32 --lr 5e-4 --seed 1 --threads 1 --work runs/train_eagle_s2 --out runs/train_eagle_s2/head
# stage 3: a third rendered set plus 20,000 rows of the target's own greedy images (agreement on the
# target's greedy images 0.890 -> 0.918, on rendered ones 0.877 -> 0.880, seed-2 split)
$PY -m mmspec.models.recipes.train_eagle --target $ZOO/transformer --init runs/train_eagle_s2/head --steps 2000 \
    --batch 32 --lr 5e-4 --seed 2 --self-distill 20000 --self-distill-greedy --threads 1 --work runs/train_eagle_s3 \
    --out runs/train_eagle_s3/head
# stage 4: the same on a fourth rendered set with 30,000 greedy rows (own_greedy_top1 0.927 on its seed-3 split)
$PY -m mmspec.models.recipes.train_eagle --target $ZOO/transformer --init runs/train_eagle_s3/head --steps 2000 \
    --batch 32 --lr 4e-4 --seed 3 --self-distill 30000 --self-distill-greedy --threads 2 --work runs/train_eagle_s4 \
    --out $ZOO/eagle_head
# the block head: four drafts per forward (FLASH's readout) from the zoo head, on a fifth rendered set plus
# 40,000 greedy rows (stage 7's data; docs/pipeline_ar_image.md)
$PY -m mmspec.models.recipes.train_eagle --target $ZOO/transformer --init $ZOO/eagle_head --num-future 4 --seed 5 \
    --self-distill 40000 --self-distill-greedy --lr 5e-4 --steps 2000 --batch 32 --threads 1 --work runs/train_eagle_f4 \
    --out $ZOO/eagle_block_head
$PY -m mmspec.models.recipes.train_mulo --out $ZOO
# the up-sampler that also reads the final rows above each block, trained on a rendered set of seed 1 plus
# 50,000 of the target's own temperature-1 samples; it replaces the first up-sampler (MuLo-SD reverify at
# temperature 1: 4.01 tokens per target call against 3.62, docs/pipeline_ar_image.md)
$PY -m mmspec.models.recipes.train_mulo --part upsampler --high-res-context --target $ZOO/transformer \
    --self-distill 50000 --seed 1 --upsampler-steps 4000 --batch 128 --work runs/train_mulo_hr --out $ZOO
$PY -m mmspec.models.recipes.build_zoo_t2i --folder $ZOO
$PY -m mmspec.models.recipes.report_t2i --model $ZOO/transformer --threads 1 --out $ZOO/report.json
