"""``mmspec generate``: images from prompts with a discrete AR image pipeline, speculatively.

Runs the chosen method and, with the same prompts and seed, the target-only baseline, writes PNGs
(plus acceptance overlays) and prints wall time, speedup, mean accepted length and target calls.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import torch

from mmspec.cpu_gemm import add_cpu_gemm_argument
from mmspec.pipelines.ar_image import METHODS, ARImagePipeline, fast_method_kwargs, head_num_future
from mmspec.validation import dtype_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="text prompts (the shapes zoo knows the shapes world's words)")
    parser.add_argument("--pipeline", default="mmspec/shapes-t2i", help="zoo id or a saved pipeline folder")
    parser.add_argument("--method", default="eagle", choices=METHODS)
    parser.add_argument("--outdir", type=Path, default=Path("outputs"))
    parser.add_argument("--num-images", type=int, default=1, help="images per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--guidance-scale", type=float, default=3.0)
    parser.add_argument("--method-kwargs", default="{}",
                        help='JSON of extra pipeline arguments, e.g. \'{"lantern_delta": 0.3}\', over the '
                             "method's fast settings (fast_method_kwargs in mmspec.pipelines.ar_image)")
    parser.add_argument("--scale", type=int, default=8, help="nearest-neighbour upscaling of the written PNGs")
    parser.add_argument("--no-baseline", action="store_true", help="skip the target-only comparison run")
    parser.add_argument("--dtype", type=dtype_argument, default=torch.float32,
                        help="compute precision, float32 (default) or bfloat16 (faster verification on CPUs "
                             "with bfloat16 instructions; the baseline runs in the same precision)")
    add_cpu_gemm_argument(parser)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "prompt"


def _timed(pipe: ARImagePipeline, prompts: list[str], method: str, seed: int, kwargs: dict) -> tuple[Any, float]:
    start = time.perf_counter()
    out = pipe(prompts, method=method, generator=torch.Generator().manual_seed(seed), **kwargs)
    return out, time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    try:
        extra = json.loads(args.method_kwargs)
    except json.JSONDecodeError as error:
        raise SystemExit(f"--method-kwargs is not valid JSON: {error}") from None
    if not isinstance(extra, dict):
        raise SystemExit("--method-kwargs must be a JSON object")
    if args.scale < 1:
        raise SystemExit("--scale must be >= 1")
    try:
        pipe = ARImagePipeline.from_pretrained(args.pipeline, torch_dtype=args.dtype)
    except (FileNotFoundError, OSError, ValueError) as error:
        raise SystemExit(f"cannot load {args.pipeline!r}: {error}") from None
    pipe.set_progress_bar_config(disable=True)
    pipe.set_cpu_gemm(args.cpu_gemm)
    batch = len(args.prompts) * args.num_images  # one call generates every image
    # a tree replaces the fast chain; the image vocabulary caps LANTERN's fast neighbourhood on small codebooks
    fast = {} if "tree" in extra else \
        fast_method_kwargs(args.method, args.greedy, batch, head_num_future(pipe), int(pipe.vqvae.vocab_size))
    kwargs = dict(do_sample=not args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  guidance_scale=args.guidance_scale, num_images_per_prompt=args.num_images, output_type="pil",
                  **{**fast, **extra})
    prompts = list(args.prompts)
    try:
        # warm-up (first-call overheads are not the method's), then the measured runs
        pipe(prompts[:1], method=args.method, output_type="tokens",
             **{k: v for k, v in kwargs.items() if k not in ("output_type", "num_images_per_prompt")})
        out, seconds = _timed(pipe, prompts, args.method, args.seed, kwargs)
        baseline = None if args.no_baseline or args.method == "none" else _timed(pipe, prompts, "none", args.seed, kwargs)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None

    args.outdir.mkdir(parents=True, exist_ok=True)
    overlays = out.drafted_overlay()
    for i, (image, overlay) in enumerate(zip(out.images, overlays)):
        name = f"{i // args.num_images:02d}-{_slug(prompts[i // args.num_images])}-{i % args.num_images}"
        size = (image.width * args.scale, image.height * args.scale)
        image.resize(size, resample=0).save(args.outdir / f"{name}.png")
        overlay.resize(size, resample=0).save(args.outdir / f"{name}-drafted.png")
    images = len(out.images)
    stats = out.stats
    print(f"wrote {images} images (+ drafted-token overlays) to {args.outdir}")
    print(f"{args.method}: {seconds:.2f} s, {images / seconds:.2f} images/s, mean accepted length "
          f"{stats.mean_accepted_length:.2f}, target calls per image {stats.target_calls / images:.1f}, "
          f"drafted tokens kept {float(out.drafted.float().mean()):.1%}")
    if baseline is not None:
        base, base_seconds = baseline
        print(f"none (baseline, same prompts and seed): {base_seconds:.2f} s, target calls per image "
              f"{base.stats.target_calls / images:.1f}")
        print(f"speedup: {base_seconds / seconds:.2f}x")
    return 0
