"""Assemble the ``mmspec/shapes-t2i`` pipeline folder from the trained parts.

After ``train_t2i`` (transformer/), ``train_eagle`` (eagle_head/, and with ``--num-future`` the optional
eagle_block_head/) and ``train_mulo`` (mulo_drafter/, mulo_upsampler/) have written their parts into the
folder, this adds the VQ tokenizer, the pipeline's ``model_index.json`` (diffusers layout) and the methods'
recommended settings (``speculation_config.json``, :data:`SPECULATION_SETTINGS`), so
``ARImagePipeline.from_pretrained("mmspec/shapes-t2i")`` works offline and ``pipe(..., method="eagle")`` runs
with the settings the benchmark measured best.

    python -m mmspec.models.recipes.build_zoo_t2i --folder models/zoo/shapes-t2i
    python -m mmspec.models.recipes.build_zoo_t2i --folder models/zoo/shapes-t2i --settings-only  # the table alone
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mmspec.models.eagle import EagleHead
from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.mulo import TokenUpsampler
from mmspec.models.recipes.common import DEFAULT_VQ, save_zoo_folder
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import VQTokenizer

#: The command of the benchmark that measured these settings (one table per decoding mode and batch size, every
#: method against target-only; docs/pipeline_ar_image.md, "Speed and quality on the zoo"). The variants below
#: were picked from screens of the same command with ``--method-kwargs`` variants of each case (e.g.
#: ``'{"eagle, K=5": {"like": "eagle", "num_draft_tokens": 5}}'``); each row names its screen.
MEASURED_BY = ("python -m mmspec.evaluation.bench_ar_image --methods none eagle lantern lantern++ sjd gsd mulo "
               "'mulo, reverify' --modes greedy temperature_1 --batch-sizes 1 4 --quality-prompts 25 --quality-seeds 2 "
               "--speed-prompts 3 --repeats 3 --out docs/benchmarks/ar_image_context_full_cpu.md")

_BLOCK_CHAIN = {"num_draft_tokens": 4, "draft_confidence_threshold": 0.3, "lookup_tail": 16, "lookup_only_from": 4}

#: The zoo's recommended settings per method (``speculation_config.json``): the fastest measured on the zoo
#: (2-core CPU, float32, CFG 3; ``MEASURED_BY``) among the settings whose quality held.
#:
#: ===========================  ==========================================================================
#: case                         settings and why
#: ===========================  ==========================================================================
#: eagle, base                  chains of up to 8 drafts cut where the head's confidence falls below 0.5
#:                              (sampling one image per call)
#: eagle / lantern, greedy, 1   one block of 4 drafts from the block head (one forward), cut at 0.3, then a
#:                              lookup tail of up to 16 copies of the row above; rounds whose tail already
#:                              has 4 copies skip the head (11-14 % and another 6-7 % faster than chains of
#:                              up to 12 without a tail)
#: eagle, sampled, 1            argmax drafts (point masses, accepted exactly with probability p) in blocks
#:                              with the greedy block chain and its tail: on an idle machine 1.60x against
#:                              1.50x for sampled chains of up to 8, whose two-row guided head steps cost more
#:                              than their extra acceptance gains (bench_ar_image --modes temperature_1
#:                              --quality-prompts 0 with --method-kwargs variants, 2026-12-08)
#: eagle, sampled, >= 2         chains of up to 2 (batch 4: the forward is compute-bound and every drafted
#:                              position costs verification; 1.06-1.08x where chains of 4 ran 0.93x)
#: eagle / lantern, greedy, >=2 chains of up to 5 (batch 4: 1.31-1.37x against 1.22x with 8)
#: lantern, sampled, 1          argmax drafts in blocks with the greedy block chain and its tail (4.76
#:                              tokens per round against 3.86-4.09 with sampled drafts)
#: lantern, sampled, >= 2       argmax drafts, chains of up to 4, token by token (1.23x against 1.11x with 2)
#: lantern, sampled             the LANTERN++ bound lam 10 over the 512 nearest codes (13.8 target calls per
#:                              image against 15.3 for lam 3 over 64, GenEval-shapes 0.904 against EAGLE's
#:                              0.840; lam 20 over 1024 lost quality and diversity)
#: sjd / scd / gsd              a window of 8 slots refilled with copies of the left neighbour (SJD 1.03x
#:                              and GSD 0.89x with the paper's 16 random slots); GSD groups of 6 without the
#:                              probability filter (GenEval-shapes within noise of target-only at
#:                              temperature 1, where G=10 lost 0.07)
#: sjd_pac                      SJD's window of 8 left copies with the paper's K = 4, D = 3 trees (3.63 tokens
#:                              per target call against 3.28 for K = 4, D = 2 and 3.66 with a window of 12;
#:                              temperature 1, batch 1, 12 prompts x 2 seeds, docs/pipeline_ar_image.md)
#: mulo                         "reverify" resampling (the paper's "parallel" collapses this zoo's images:
#:                              GenEval-shapes 0.24 against 0.85), the class defaults otherwise
#: entropy_sd / cool_sd         LANTERN's drafting and its 512 nearest codes (below)
#: ===========================  ==========================================================================
#: LANTERN's drafting (chains, blocks, argmax drafts) without its acceptance rule; the relaxed rules share it
_LANTERN_DRAFTING: dict = {
    "settings": {"num_draft_tokens": 8, "draft_confidence_threshold": 0.5},
    "variants": [
        {"when": {"greedy": True, "batch_size": 1}, "settings": _BLOCK_CHAIN},
        {"when": {"greedy": False, "batch_size": 1}, "settings": {"argmax_drafts": True, **_BLOCK_CHAIN}},
        {"when": {"greedy": False, "min_batch_size": 2},
         "settings": {"argmax_drafts": True, "num_draft_tokens": 4, "draft_confidence_threshold": 0.5}},
        {"when": {"greedy": True, "min_batch_size": 2},
         "settings": {"num_draft_tokens": 5, "draft_confidence_threshold": 0.5}},
    ],
}
SPECULATION_SETTINGS: dict[str, dict] = {
    "eagle": {
        "settings": {"num_draft_tokens": 8, "draft_confidence_threshold": 0.5},
        "variants": [
            {"when": {"greedy": True, "batch_size": 1}, "settings": _BLOCK_CHAIN},
            {"when": {"greedy": False, "batch_size": 1}, "settings": {"argmax_drafts": True, **_BLOCK_CHAIN}},
            {"when": {"greedy": False, "min_batch_size": 2},
             "settings": {"num_draft_tokens": 2, "draft_confidence_threshold": 0.5}},
            {"when": {"greedy": True, "min_batch_size": 2},
             "settings": {"num_draft_tokens": 5, "draft_confidence_threshold": 0.5}},
        ],
    },
    "lantern": {
        "settings": _LANTERN_DRAFTING["settings"],
        "variants": [*_LANTERN_DRAFTING["variants"], {"when": {"greedy": False}, "settings": {"k": 512, "lam": 10.0}}],
    },
    "sjd": {"settings": {"window": 8, "init": "left"}},
    "scd": {"settings": {"window": 8, "init": "left"}},
    "sjd_pac": {"settings": {"window": 8, "init": "left", "tree_width": 4, "tree_depth": 3}},
    "gsd": {"settings": {"window": 8, "init": "left", "group_size": 6, "prob_threshold": 1.0}},
    "mulo": {"settings": {"resample": "reverify"}},
}
#: entropy_sd and cool_sd draft as LANTERN does (its settings and variants, over the same 512 nearest codes under
#: sampling); only their per-token relaxation differs: 2.58x and 2.56x at temperature 1 and batch 1 against 1.48x
#: and 1.61x with the classes' own sampled chains (docs/benchmarks/ar_image_beyond_cpu.md).
for _relaxed in ("entropy_sd", "cool_sd"):
    SPECULATION_SETTINGS[_relaxed] = {
        "settings": _LANTERN_DRAFTING["settings"],
        "variants": [*_LANTERN_DRAFTING["variants"], {"when": {"greedy": False}, "settings": {"k": 512}}],
    }


def _word_vocabulary(folder: Path) -> WordTokenizer:
    """The prompt vocabulary: the assembled folder's ``text_tokenizer/`` component, else the file the training
    recipe wrote beside the transformer (``transformer/text_vocab.json``, a folder being assembled)."""
    if (folder / "text_tokenizer").is_dir():
        return WordTokenizer.from_pretrained(folder / "text_tokenizer")
    return WordTokenizer.load(folder / "transformer" / "text_vocab.json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=Path("models/zoo/shapes-t2i"))
    parser.add_argument("--vq", type=Path, default=DEFAULT_VQ)
    parser.add_argument("--settings-only", action="store_true",
                        help="write only speculation_config.json into an assembled folder")
    args = parser.parse_args(argv)
    from mmspec.pipelines import ARImagePipeline

    folder = args.folder
    if args.settings_only:
        pipe = ARImagePipeline.from_pretrained(folder)
        pipe.set_speculation_settings(SPECULATION_SETTINGS)
        print(f"wrote {pipe.speculation_settings.save(folder)}")
        return
    missing = [p for p in ("transformer", "eagle_head", "mulo_drafter", "mulo_upsampler") if not (folder / p).is_dir()]
    if missing:
        raise SystemExit(f"{folder} lacks {missing}: run the training recipes first (see the module docstring)")
    half = torch.float16  # these parts are kept in fp16 (loading computes in fp32; the block head is rounded here)
    pipe = ARImagePipeline(
        transformer=LlamaGenTransformer.from_pretrained(folder / "transformer", torch_dtype=half),
        vqvae=VQTokenizer.from_pretrained(args.vq),
        eagle_head=EagleHead.from_pretrained(folder / "eagle_head"),
        text_tokenizer=_word_vocabulary(folder),
        mulo_drafter=LlamaGenTransformer.from_pretrained(folder / "mulo_drafter", torch_dtype=half),
        mulo_upsampler=TokenUpsampler.from_pretrained(folder / "mulo_upsampler", torch_dtype=half),
        eagle_block_head=EagleHead.from_pretrained(folder / "eagle_block_head", torch_dtype=half)
        if (folder / "eagle_block_head").is_dir() else None,
    )
    pipe.set_speculation_settings(SPECULATION_SETTINGS)
    save_zoo_folder(pipe, folder)
    print(f"wrote {folder}/model_index.json and {folder}/speculation_config.json")


if __name__ == "__main__":
    main()
