"""Command line of the shapes world: measure the evaluator, time the generators, save example grids.

    python -m mmspec.world selfcheck --scenes 1000          # evaluator exactness on clean renders
    python -m mmspec.world bench                            # scenes/renders/parses/dataset items per second
    python -m mmspec.world show --out world.png --difficulty 1   # a grid of example images
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import numpy as np

from mmspec.files import save_image_atomic

from .datasets import ShapesImageDataset
from .evaluator import evaluate, parse_image, scene_matches
from .prompts import make_prompt_set, scene_for_prompt
from .render import render_scene
from .scene import rng_for, sample_scene


def selfcheck(num_scenes: int, sizes: Sequence[int], difficulties: Sequence[float], seed: int) -> dict:
    """Fraction of random scenes (the ``test`` stream) whose clean render the evaluator reads exactly,
    plus the GenEval score of renders of the evaluation prompt set's scenes (should all be 1.0)."""
    out = {}
    prompts = make_prompt_set()
    for size in sizes:
        for d in difficulties:
            scenes = [sample_scene(rng_for("test", seed, i)) for i in range(num_scenes)]
            right = sum(scene_matches(parse_image(render_scene(s, size, d)), s) for s in scenes)
            images = [render_scene(scene_for_prompt(p, rng_for("test", seed, 10**6 + i)), size, d) for i, p in enumerate(prompts)]
            out[f"size_{size}_difficulty_{d:g}"] = {
                "scene_accuracy": right / num_scenes,
                "num_scenes": num_scenes,
                "geneval_overall": evaluate(images, prompts).overall,
            }
            print(f"size {size} difficulty {d:g}: {right}/{num_scenes} scenes exact, "
                  f"GenEval {out[f'size_{size}_difficulty_{d:g}']['geneval_overall']:.4f}", flush=True)
    return out


def bench(n: int = 2000) -> dict:
    """Throughput on one process (numbers depend on the machine and its load)."""
    res = {}
    t = time.perf_counter()
    scenes = [sample_scene(i) for i in range(n)]
    res["sample_scene_per_s"] = n / (time.perf_counter() - t)
    for d in (0.0, 1.0, 2.0):
        t = time.perf_counter()
        images = [render_scene(s, 32, d) for s in scenes]
        res[f"render32_difficulty{d:g}_per_s"] = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for img in images[: n // 4]:
        parse_image(img)
    res["parse32_per_s"] = (n // 4) / (time.perf_counter() - t)
    for texts in (False, True):
        ds = ShapesImageDataset(n, texts=texts)
        t = time.perf_counter()
        for i in range(n // 2):
            ds[i]
        res[f"dataset_items_per_s_texts_{texts}"] = (n // 2) / (time.perf_counter() - t)
    return {k: round(v) for k, v in res.items()}


def show(out: str, difficulty: float, image_size: int, rows: int, cols: int, seed: int) -> None:
    from PIL import Image

    tiles = [render_scene(sample_scene(rng_for("test", seed, i)), image_size, difficulty) for i in range(rows * cols)]
    grid = np.concatenate([np.concatenate(tiles[r * cols : (r + 1) * cols], axis=1) for r in range(rows)], axis=0)
    save_image_atomic(Image.fromarray(grid), out)
    print(f"wrote {out}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mmspec.world", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("selfcheck", help="evaluator exactness on clean renders")
    p.add_argument("--scenes", type=int, default=1000)
    p.add_argument("--sizes", type=int, nargs="+", default=[32])
    p.add_argument("--difficulties", type=float, nargs="+", default=[0.0, 1.0, 2.0])
    p.add_argument("--seed", type=int, default=0)
    sub.add_parser("bench", help="throughput of sampling, rendering, parsing and datasets")
    p = sub.add_parser("show", help="save a grid of example images")
    p.add_argument("--out", required=True)
    p.add_argument("--difficulty", type=float, default=1.0)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--cols", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cmd == "selfcheck":
        print(json.dumps(selfcheck(args.scenes, args.sizes, args.difficulties, args.seed), indent=1))
    elif args.cmd == "bench":
        print(json.dumps(bench(), indent=1))
    else:
        show(args.out, args.difficulty, args.image_size, args.rows, args.cols, args.seed)


if __name__ == "__main__":
    main()
