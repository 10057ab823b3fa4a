"""Assemble and report the ``mmspec/shapes-t2i-continuous`` zoo entry.

``build`` writes the pipeline folder (``ContinuousARImagePipeline.save_pretrained``: target ``transformer/``,
``draft_transformer/``, the zoo's continuous tokenizer as ``vae/``, the word vocabulary, and the methods'
recommended settings ``speculation_config.json``, :data:`SPECULATION_SETTINGS`) from the two trained model
folders of ``train_mar``; the models stay fp16 on disk. ``settings`` writes only ``speculation_config.json``
into an assembled folder.

``report`` samples one image per evaluation prompt with target-only decoding (classifier-free guidance,
MAR's linear schedule) and scores the images with the exact evaluator (GenEval-shapes) and FID with the
shapes feature network against renders of the same prompts; ``--model`` reports a bare trained model
folder (e.g. a checkpoint during training), ``--pipeline`` a built folder or zoo id.

    python -m mmspec.models.recipes.report_mar build --target runs/mar_target/model --draft runs/mar_draft/model \\
        --folder models/zoo/shapes-t2i-continuous
    python -m mmspec.models.recipes.report_mar settings --folder models/zoo/shapes-t2i-continuous
    python -m mmspec.models.recipes.report_mar report --pipeline mmspec/shapes-t2i-continuous \\
        --out models/zoo/shapes-t2i-continuous/report.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmspec.files import write_json_atomic
from mmspec.models.mar import MARModel
from mmspec.models.recipes.common import save_zoo_folder
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import ContinuousTokenizer, zoo_tokenizer_path
from mmspec.world import evaluate, make_prompt_set, render_scene, scene_for_prompt

#: The command of the benchmark that measured these settings (docs/pipeline_continuous.md, "Speed and quality
#: on the zoo"): gamma 3 and 8 at pre-fill ratios 0.05-0.3, at one token per MAR iteration (64 iterations),
#: against target-only decoding, when method settings were still call keywords.
MEASURED_BY = ("python -m mmspec.evaluation.bench_continuous --threads 1 --quality-prompts 50 --quality-seeds 3 "
               "--repeats 3 --num-iter 64 --configs '{\"none\": {\"method\": \"none\"}, \"cspd\": {\"method\": \"cspd\"}, "
               "\"cspd, gamma 3, prefill 0.2\": {\"method\": \"cspd\", \"draft_length\": 3, \"prefill_ratio\": 0.2}, "
               "\"cspd, gamma 3, prefill 0.25\": {\"method\": \"cspd\", \"draft_length\": 3, \"prefill_ratio\": 0.25}, "
               "\"cspd, gamma 3, prefill 0.3\": {\"method\": \"cspd\", \"draft_length\": 3, \"prefill_ratio\": 0.3}, "
               "\"none, 32 iterations\": {\"method\": \"none\", \"num_iter\": 32}}' --out runs/cont64/final.md")

#: The zoo's recommended settings per method (``speculation_config.json``): the fastest measured on the zoo
#: (one CPU thread, float32, guidance 3; ``MEASURED_BY``) among the settings whose quality held. CSpD: three
#: draft iterations per target pass after a quarter of the tokens is pre-filled (1.54x at batch 32, 1.32x at
#: batch 8, none at batch 1; GenEval-shapes 0.827 against the target's 0.823). The official code's gamma 8
#: with 5 % pre-filled was faster (2.43x) but 0.12 below the target, and pre-filling 0.2 was 0.02 below it.
SPECULATION_SETTINGS: dict[str, dict] = {
    "cspd": {"settings": {"draft_length": 3, "prefill_ratio": 0.25, "verify_order": "independent",
                          "verify_context": "round", "density_temperature": 1.0}},
}


def build(target: Path, draft: Path, folder: Path, tokenizer: Path, clip_denoised: float | None = 7.0,
          num_sampling_steps: int | None = None) -> None:
    """Write the pipeline folder from two ``train_mar`` model folders (setting both models' sampler
    options ``clip_denoised`` and, if given, ``num_sampling_steps`` in their configs)."""
    from mmspec.pipelines.continuous_ar_image import ContinuousARImagePipeline

    models = []
    for name, path in (("--target", target), ("--draft", draft)):
        if not (path / "config.json").is_file():
            raise SystemExit(f"{name} {path} is not a trained model folder (no config.json): run train_mar first")
        model = MARModel.from_pretrained(path, torch_dtype=torch.float16)
        model.register_to_config(clip_denoised=clip_denoised)
        if num_sampling_steps is not None:
            model.register_to_config(num_sampling_steps=num_sampling_steps)
        models.append(model)
    pipe = ContinuousARImagePipeline(transformer=models[0], vae=ContinuousTokenizer.from_pretrained(tokenizer),
                                     draft_transformer=models[1],
                                     text_tokenizer=WordTokenizer.load(target / "text_vocab.json"))
    pipe.set_speculation_settings(SPECULATION_SETTINGS)
    save_zoo_folder(pipe, folder)
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"wrote {folder} ({size / 1e6:.1f} MB)")


def write_settings(folder: Path) -> Path:
    """Write :data:`SPECULATION_SETTINGS` as ``speculation_config.json`` into an assembled pipeline folder
    (checked against the method configs first)."""
    from mmspec.methods import SpeculationSettings

    if not (folder / "model_index.json").is_file():
        raise SystemExit(f"{folder} is not an assembled pipeline folder (no model_index.json): run build first")
    return SpeculationSettings.from_dict("continuous", SPECULATION_SETTINGS).save(folder)


def load_pipeline(pipeline: str | None, model: Path | None, tokenizer: Path) -> Any:
    from mmspec.pipelines.continuous_ar_image import ContinuousARImagePipeline

    if pipeline is not None:
        return ContinuousARImagePipeline.from_pretrained(pipeline)
    return ContinuousARImagePipeline(transformer=MARModel.from_pretrained(model, torch_dtype=torch.float32).eval(),
                                     vae=ContinuousTokenizer.from_pretrained(tokenizer),
                                     text_tokenizer=WordTokenizer.load(model / "text_vocab.json"))


def reference_images(prompts: list[Any], difficulty: float, seed: int) -> torch.Tensor:
    """Renders of the prompts ``[N, 3, 32, 32]`` in [0, 1] (FID's real set)."""
    rng = np.random.default_rng(seed)
    arrays = [render_scene(scene_for_prompt(p, rng), 32, difficulty) for p in prompts]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0


def report(pipe: Any, per_category: int, batch: int, seed: int, difficulty: float, **call: Any) -> dict[str, Any]:
    """GenEval-shapes and FID (shapes features) of target-only samples, one image per prompt."""
    from mmspec.evaluation.fid import compute_fid

    pipe.set_progress_bar_config(disable=True)
    prompts = make_prompt_set(n_per_category=per_category)
    generator = torch.Generator().manual_seed(seed)
    images, start = [], time.time()
    for lo in range(0, len(prompts), batch):
        out = pipe([p.text for p in prompts[lo:lo + batch]], generator=generator, output_type="np", **call)
        images += list(out.images)
    seconds = time.time() - start
    result = evaluate(images, prompts)
    fake = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
    fid = compute_fid(reference_images(prompts, difficulty, seed), fake, "shapes").fid
    return {"geneval_overall": result.overall, "per_category": result.per_category, "fid_shapes": fid,
            "images": len(images), "seconds": round(seconds, 1), "call": call, "seed": seed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the pipeline folder")
    b.add_argument("--target", type=Path, required=True)
    b.add_argument("--draft", type=Path, required=True)
    b.add_argument("--folder", type=Path, default=Path("models/zoo/shapes-t2i-continuous"))
    b.add_argument("--tokenizer", type=Path, default=zoo_tokenizer_path("continuous"))
    b.add_argument("--clip-denoised", type=float, default=7.0)
    b.add_argument("--num-sampling-steps", type=int, default=None)
    w = sub.add_parser("settings", help="write only speculation_config.json into an assembled folder")
    w.add_argument("--folder", type=Path, default=Path("models/zoo/shapes-t2i-continuous"))
    r = sub.add_parser("report", help="GenEval-shapes and FID of target-only samples")
    r.add_argument("--pipeline", default=None, help="zoo id or pipeline folder")
    r.add_argument("--model", type=Path, default=None, help="a bare train_mar model folder instead of --pipeline")
    r.add_argument("--tokenizer", type=Path, default=zoo_tokenizer_path("continuous"))
    r.add_argument("--prompts", type=int, default=50, help="prompts per category (6 categories)")
    r.add_argument("--num-iter", type=int, default=32)
    r.add_argument("--num-diffusion-steps", type=int, default=None)
    r.add_argument("--guidance-scale", type=float, default=3.0)
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--batch", type=int, default=50)
    r.add_argument("--difficulty", type=float, default=0.5, help="render difficulty of FID's real images")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.target, args.draft, args.folder, args.tokenizer, args.clip_denoised, args.num_sampling_steps)
        return
    if args.command == "settings":
        print(f"wrote {write_settings(args.folder)}")
        return
    if (args.pipeline is None) == (args.model is None):
        raise SystemExit("report needs exactly one of --pipeline and --model")
    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.pipeline, args.model, args.tokenizer)
    result = report(pipe, args.prompts, args.batch, args.seed, args.difficulty, num_iter=args.num_iter,
                    num_diffusion_steps=args.num_diffusion_steps, guidance_scale=args.guidance_scale,
                    temperature=args.temperature)
    result["command"] = "python -m mmspec.models.recipes.report_mar " + " ".join(sys.argv[1:] if argv is None else argv)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        write_json_atomic(args.out, result, indent=1)


if __name__ == "__main__":
    main()
