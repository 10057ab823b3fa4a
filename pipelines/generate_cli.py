"""``mmspec generate``: images from prompts with a discrete AR image pipeline, speculatively.

Runs the chosen method with the checkpoint's stored settings for the decoding mode and batch (exactly what
``pipe(..., method=name)`` runs; ``--method-kwargs`` replaces config fields) and, with the same prompts and
seed, the target-only baseline, writes PNGs (plus acceptance overlays; each atomically, so a killed run
leaves no truncated image) and prints wall time, speedup, mean accepted length and target calls.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from mmspec.cpu_gemm import add_cpu_gemm_argument
from mmspec.devices import add_device_arguments, load_pipeline, resolved_device
from mmspec.files import save_image_atomic
from mmspec.methods import available, get
from mmspec.pipelines.ar_image import MOVED_KEYWORDS, ARImagePipeline
from mmspec.validation import guidance_scale_argument, positive_int_argument

#: the largest side, in pixels, of a PNG that ``--scale`` may write (64 MB of RGB in memory)
MAX_OUTPUT_SIDE = 4096


def lossless_methods(family: str = "ar_image") -> list[str]:
    """The registered methods of ``family`` that sample exactly the target's distribution at their default
    settings (:attr:`~mmspec.methods.MethodConfig.lossless`), with "none" (the target alone)."""
    return ["none", *(name for name in available(family) if get(name, family).lossless)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Generate images from prompts with a discrete AR image pipeline, speculatively, and "
                          "compare with target-only decoding of the same prompts and seed.")
    lossless = lossless_methods()
    lossy = [name for name in ["none", *available("ar_image")] if name not in lossless]
    parser.add_argument("prompts", nargs="+", help="text prompts (the shapes zoo knows the shapes world's words)")
    parser.add_argument("--pipeline", default="mmspec/shapes-t2i",
                        help="zoo id or a saved pipeline folder (default: %(default)s)")
    parser.add_argument("--method", default="eagle", choices=["none", *available("ar_image")],
                        help=f"speculative method (default: %(default)s) with the checkpoint's stored settings; "
                             f"lossless (exactly the target's distribution): {', '.join(lossless)}; lossy "
                             f"(relaxed acceptance, faster): {', '.join(lossy)}")
    parser.add_argument("--outdir", type=Path, default=Path("outputs"),
                        help="folder for the PNGs, created if needed; checked before generating "
                             "(default: %(default)s)")
    parser.add_argument("--num-images", type=positive_int_argument, default=1,
                        help="images per prompt (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random draw (default: %(default)s)")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample from the k most likely tokens (default: no limit)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling mass in (0, 1] (default: %(default)s, no limit)")
    parser.add_argument("--guidance-scale", type=guidance_scale_argument, default=3.0,
                        help="classifier-free guidance scale, 1.0 for none (default: %(default)s)")
    parser.add_argument("--method-kwargs", default="{}",
                        help='JSON of the method\'s config fields, e.g. \'{"delta": 0.3}\' for lantern, over the '
                             "checkpoint's stored settings (pipe.method_config(method, ...).replace(**fields); "
                             '"tree" as a JSON object; default: none)')
    parser.add_argument("--scale", type=int, default=8,
                        help=f"nearest-neighbour upscaling of the written PNGs (at most {MAX_OUTPUT_SIDE} px a side; "
                             "default: %(default)s)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the target-only comparison run")
    parser.add_argument("--repeats", type=positive_int_argument, default=3,
                        help="timed runs of the method and of the baseline, alternating, after one warm-up each "
                             "(the speedup printed is the ratio of the medians, with the range over the runs; "
                             "default: %(default)s)")
    add_device_arguments(parser, dtype_help="compute precision, float32 (default) or bfloat16 (faster verification "
                                            "on GPUs and CPUs with bfloat16 instructions; the baseline runs in "
                                            "the same precision)")
    add_cpu_gemm_argument(parser)


def check_outdir(outdir: Path) -> None:
    """``--outdir`` can take the PNGs: an existing folder, or a path whose nearest existing parent is a folder,
    writable in either case. Checked before the pipeline loads, so a bad path does not cost a whole run."""
    existing = outdir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == outdir and not outdir.is_dir():
        raise SystemExit(f"--outdir {outdir} is a file, not a folder")
    if not existing.is_dir():
        raise SystemExit(f"--outdir {outdir} cannot be created: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SystemExit(f"--outdir {outdir} is not writable ({existing} does not allow writing)")


def image_side(pipe: ARImagePipeline) -> int | None:
    """Pixels per side of the pipeline's images: its token grid times the tokenizer's pixels per token
    (``patch_size`` of the zoo's VQ tokenizer, ``downsample_factor`` of LlamaGen's VQ), or the decoder's
    configured ``image_size`` (Janus); None when the tokenizer states neither."""
    config = getattr(pipe.vqvae, "config", None)
    per_token = getattr(config, "patch_size", None) or getattr(pipe.vqvae, "downsample_factor", None)
    if per_token:
        return pipe.grid_size * int(per_token)
    size = getattr(config, "image_size", None)
    return int(size) if size else None


def check_scale(scale: int, side: int | None = None) -> None:
    """``--scale`` is at least 1 and keeps the written PNGs at most :data:`MAX_OUTPUT_SIDE` pixels a side
    (``side``: the generated images' side; None checks the scale alone). Why: the upscaled image is built
    in memory before it is written, so an unbounded scale exhausts memory instead of writing a file."""
    if scale < 1:
        raise SystemExit("--scale must be >= 1")
    if (side or 1) * scale > MAX_OUTPUT_SIDE:
        wanted = f"{side * scale}x{side * scale} px PNGs from {side}x{side} px images" if side else \
            f"PNGs at least {scale} px a side"
        raise SystemExit(f"--scale {scale} would write {wanted}; the limit is {MAX_OUTPUT_SIDE} px a side "
                         f"(use --scale {max(1, MAX_OUTPUT_SIDE // (side or 1))} or less)")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "prompt"


def _timed_runs(pipe: ARImagePipeline, prompts: list[str], method: Any, seed: int, kwargs: dict, repeats: int,
                baseline: bool) -> tuple[Any, Any]:
    """The method's output and the timing report of the method and (with ``baseline``) target-only decoding:
    both warmed up once, then ``repeats`` alternating timed calls each (the benchmarks' harness,
    :func:`mmspec.evaluation.speed.run_benchmark`), every call with the same prompts and seed."""
    from mmspec.evaluation.speed import RunResult, run_benchmark

    outputs: dict[str, Any] = {}

    def case(name: str, which: Any) -> Any:
        def call() -> RunResult:
            out = pipe(prompts, method=which, generator=torch.Generator().manual_seed(seed), **kwargs)
            outputs[name] = out
            return RunResult(num_items=len(out.images), unit="images", stats=out.stats)
        return call

    cases = {"method": case("method", method)}
    if baseline:
        cases = {"none": case("none", "none"), **cases}
    report = run_benchmark(cases, baseline="none" if baseline else "method", warmup=1, repeats=repeats, seed=seed)
    return outputs["method"], report


def method_for(pipe: ARImagePipeline, method: str, fields: dict[str, Any], *, do_sample: bool, batch_size: int,
               guidance_scale: float) -> Any:
    """``method=`` of the run: the name alone (the checkpoint's stored settings) without ``fields``, else the
    stored config with ``fields`` replaced. A field the method's config lacks exits naming it."""
    if not fields:
        return method
    if method == "none":
        raise SystemExit(f"--method-kwargs: method 'none' (target only) has no settings; got {sorted(fields)}")
    config = pipe.method_config(method, do_sample=do_sample, batch_size=batch_size, guidance_scale=guidance_scale)
    unknown = [name for name in fields if name not in config.field_names()]
    if unknown:
        moved = MOVED_KEYWORDS.get(unknown[0])
        hint = f"; {unknown[0]} is now the field {moved[0]!r}" if moved and moved[0] in config.field_names() else ""
        raise SystemExit(f"--method-kwargs: {type(config).__name__} (method {method!r}) has no field {unknown[0]!r}; "
                         f"its fields are {', '.join(config.field_names())}{hint}")
    try:
        return type(config).from_dict({**config.to_dict(), **fields}, source="--method-kwargs")
    except ValueError as error:
        raise SystemExit(f"--method-kwargs: {error}") from None


def run(args: argparse.Namespace) -> int:
    try:
        extra = json.loads(args.method_kwargs)
    except json.JSONDecodeError as error:
        raise SystemExit(f"--method-kwargs is not valid JSON: {error}") from None
    if not isinstance(extra, dict):
        raise SystemExit("--method-kwargs must be a JSON object")
    check_scale(args.scale)
    check_outdir(args.outdir)
    try:
        pipe = load_pipeline(ARImagePipeline, args.pipeline, device=resolved_device(args), dtype=args.dtype)
    except (FileNotFoundError, OSError, ValueError) as error:
        raise SystemExit(f"cannot load {args.pipeline!r}: {error}") from None
    check_scale(args.scale, image_side(pipe))
    pipe.set_progress_bar_config(disable=True)
    pipe.set_cpu_gemm(args.cpu_gemm)
    batch = len(args.prompts) * args.num_images  # one call generates every image
    # the sampling settings are all the baseline gets; the method's settings are its config
    kwargs = dict(do_sample=not args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  guidance_scale=args.guidance_scale, num_images_per_prompt=args.num_images, output_type="pil")
    prompts = list(args.prompts)
    try:
        method = method_for(pipe, args.method, extra, do_sample=not args.greedy, batch_size=batch,
                            guidance_scale=args.guidance_scale)
        out, report = _timed_runs(pipe, prompts, method, args.seed, kwargs, args.repeats,
                                  baseline=not args.no_baseline and args.method != "none")
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None

    args.outdir.mkdir(parents=True, exist_ok=True)
    overlays = out.drafted_overlay()
    for i, (image, overlay) in enumerate(zip(out.images, overlays)):
        name = f"{i // args.num_images:02d}-{_slug(prompts[i // args.num_images])}-{i % args.num_images}"
        size = (image.width * args.scale, image.height * args.scale)
        save_image_atomic(image.resize(size, resample=0), args.outdir / f"{name}.png")
        save_image_atomic(overlay.resize(size, resample=0), args.outdir / f"{name}-drafted.png")
    images = len(out.images)
    stats = out.stats
    timed = report.cases["method"]
    print(f"wrote {images} images (+ drafted-token overlays) to {args.outdir}")
    print(f"{args.method}: {timed.median_s:.2f} s (median of {args.repeats}), {timed.items_per_s:.2f} images/s, "
          f"mean accepted length {stats.mean_accepted_length:.2f}, target calls per image "
          f"{stats.target_calls / images:.1f}, drafted tokens kept {float(out.drafted.float().mean()):.1%}")
    if "none" in report.cases:
        base = report.cases["none"]
        base_calls = base.stats["target_calls"] if base.stats else float("nan")
        low, high = timed.paired_speedup_range or (timed.speedup, timed.speedup)
        print(f"none (baseline, same prompts and seed): {base.median_s:.2f} s (median of {args.repeats}), "
              f"target calls per image {base_calls / images:.1f}")
        print(f"speedup: {timed.speedup:.2f}x (range {low:.2f}-{high:.2f}x over {args.repeats} alternating runs "
              "after one warm-up each)")
    return 0
