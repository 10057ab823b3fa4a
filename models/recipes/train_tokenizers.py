"""Train the shapes-world image tokenizers (VQ and continuous) and write weights plus a report.

    python -m mmspec.models.recipes.train_tokenizers --out models/zoo/tokenizers

Deterministic for a seed and thread count (default 2 threads); a few CPU minutes. Writes
``<out>/vq`` and ``<out>/continuous`` (save_pretrained folders, fp32 safetensors, well under 5 MB)
and ``<out>/report.json`` with the reconstruction quality measured by the exact evaluator on
held-out scenes (a random stream never used for training) at difficulties 0, 1 and 2:

* ``scene_accuracy``: fraction of reconstructions the evaluator reads exactly right (every object's
  shape, colour and size class, centre within one pixel at 32x32, nothing extra);
* ``geneval``: GenEval-style score of reconstructions of scenes drawn for the evaluation prompt set;
* MSE / PSNR against the input, and for the VQ tokenizer codebook usage and perplexity.

Training data: random scenes (1-4 objects) of the ``tokenizer-train`` stream, rendered at 32x32 with
difficulties cycling through 0, 1, 2, so one tokenizer serves every difficulty.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from mmspec.models.recipes.autoencoder_training import train_autoencoder
from mmspec.models.tokenizers import ContinuousTokenizer, VQTokenizer
from mmspec.world.evaluator import evaluate, parse_image, scene_matches
from mmspec.world.prompts import make_prompt_set, scene_for_prompt
from mmspec.world.render import render_scene, to_tensor
from mmspec.world.scene import rng_for, sample_scene


def training_images(num_images: int, seed: int, image_size: int, difficulties: Sequence[float]) -> torch.Tensor:
    """Renders of random training scenes, difficulty cycling over ``difficulties``: [N, 3, H, W] in [0, 1]."""
    images = [
        render_scene(sample_scene(rng_for("tokenizer-train", seed, i)), image_size, float(difficulties[i % len(difficulties)]))
        for i in range(num_images)
    ]
    return to_tensor(np.stack(images))


@torch.no_grad()
def reconstruction_report(
    tokenizer: VQTokenizer | ContinuousTokenizer,
    num_scenes: int,
    seed: int,
    image_size: int,
    difficulties: Sequence[float],
    num_prompts_per_category: int = 100,
) -> dict:
    """Exact-evaluator accuracy and pixel error of reconstructions of held-out scenes."""
    report: dict = {}
    for d in difficulties:
        scenes = [sample_scene(rng_for("tokenizer-heldout", seed, i)) for i in range(num_scenes)]
        images = to_tensor(np.stack([render_scene(s, image_size, float(d)) for s in scenes]))
        grid = tokenizer.encode(images)
        recon = tokenizer.decode(grid)
        right = sum(scene_matches(parse_image(r), s) for r, s in zip(recon, scenes))
        mse = float(((recon - images) ** 2).mean())
        entry = {
            "scene_accuracy": right / num_scenes,
            "num_scenes": num_scenes,
            "mse": mse,
            "psnr_db": 10 * math.log10(1.0 / max(mse, 1e-12)),
        }
        if isinstance(tokenizer, VQTokenizer):
            counts = torch.bincount(grid.flatten(), minlength=tokenizer.vocab_size).double()
            p = counts[counts > 0] / counts.sum()
            entry["codes_used"] = int((counts > 0).sum())
            entry["perplexity"] = float(torch.exp(-(p * p.log()).sum()))
        prompts = make_prompt_set(num_prompts_per_category, seed=0)
        p_scenes = [scene_for_prompt(p, rng_for("tokenizer-heldout", seed, 1_000_000 + j)) for j, p in enumerate(prompts)]
        p_images = to_tensor(np.stack([render_scene(s, image_size, float(d)) for s in p_scenes]))
        result = evaluate(list(tokenizer.decode(tokenizer.encode(p_images))), prompts)
        entry["geneval"] = {"overall": result.overall, **result.per_category}
        report[f"difficulty_{d:g}"] = entry
    return report


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder (vq/, continuous/, report.json)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (results are deterministic per count)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--train-images", type=int, default=4000)
    parser.add_argument("--codebook-size", type=int, default=2048)
    parser.add_argument("--kmeans-iters", type=int, default=20)
    parser.add_argument("--latent-dim", type=int, default=16)
    parser.add_argument("--ae-steps", type=int, default=3000)
    parser.add_argument("--heldout", type=int, default=1000, help="held-out scenes per difficulty")
    parser.add_argument("--prompts-per-category", type=int, default=100)
    parser.add_argument("--only", choices=["vq", "continuous"], default=None, help="train one tokenizer only")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    difficulties = (0.0, 1.0, 2.0)
    start = time.time()
    print(f"rendering {args.train_images} training images ...", flush=True)
    images = training_images(args.train_images, args.seed, args.image_size, difficulties)
    report: dict = {
        "command": "python -m mmspec.models.recipes.train_tokenizers " + " ".join(argv if argv is not None else []),
        "seed": args.seed,
        "threads": args.threads,
        "train_images": args.train_images,
        "train_difficulties": list(difficulties),
        "image_size": args.image_size,
        "heldout_scenes_per_difficulty": args.heldout,
    }
    if args.only in (None, "vq"):
        t0 = time.time()
        vq = VQTokenizer(codebook_size=args.codebook_size, patch_size=args.patch_size, image_size=args.image_size)
        patches = vq.patchify(images).reshape(-1, vq.patch_dim)
        print(f"k-means: {patches.shape[0]} patches -> {args.codebook_size} entries", flush=True)
        vq.fit_codebook(patches, iters=args.kmeans_iters, seed=args.seed, log=True)
        train_s = time.time() - t0
        vq.save_pretrained(os.path.join(args.out, "vq"))
        print("evaluating vq reconstructions ...", flush=True)
        report["vq"] = {
            "config": dict(vq.config),
            "train_seconds": round(train_s, 1),
            "tokens_per_image": vq.grid_size() ** 2,
            "heldout": reconstruction_report(vq, args.heldout, args.seed, args.image_size, difficulties,
                                             args.prompts_per_category),
        }
    if args.only in (None, "continuous"):
        t0 = time.time()
        ae = ContinuousTokenizer(latent_dim=args.latent_dim, patch_size=args.patch_size, image_size=args.image_size)
        patches = ae.patchify(images).reshape(-1, ae.patch_dim)
        print(f"autoencoder: {patches.shape[0]} patches, {args.ae_steps} steps", flush=True)
        train_autoencoder(ae, patches, steps=args.ae_steps, seed=args.seed, log_every=500)
        train_s = time.time() - t0
        ae.save_pretrained(os.path.join(args.out, "continuous"))
        print("evaluating continuous reconstructions ...", flush=True)
        report["continuous"] = {
            "config": dict(ae.config),
            "train_seconds": round(train_s, 1),
            "tokens_per_image": ae.grid_size() ** 2,
            "heldout": reconstruction_report(ae, args.heldout, args.seed, args.image_size, difficulties,
                                             args.prompts_per_category),
        }
    report["total_seconds"] = round(time.time() - start, 1)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=False, default=str)
    print(json.dumps({k: v for k, v in report.items() if k in ("vq", "continuous")}, indent=1, default=str)[:3000])
    return report


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
