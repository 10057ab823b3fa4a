"""Rows of the target's own samples for the shapes t2i drafters' recipes (``train_eagle``, ``train_mulo``).

Teacher forcing on rendered images shows a drafter the data's token sequences, but at inference it drafts
continuations of the target's own guided samples, whose statistics differ (guidance sharpens them, and the
target draws its own blobs and backgrounds). ``--self-distill N`` adds N training rows whose image tokens
the target itself generated for the first N training captions (temperature 1, or argmax with
``--self-distill-greedy``; guidance ``--self-distill-guidance``), made once and cached in the work folder:
the self-distillation of Medusa-2 and EAGLE's regenerated data.
"""

from __future__ import annotations

import argparse

import torch

from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.recipes.common import args_key, cached_data


def add_self_distill_arguments(parser: argparse.ArgumentParser) -> None:
    """``--self-distill N``, ``--self-distill-guidance``, ``--self-distill-batch``, ``--self-distill-greedy``."""
    parser.add_argument("--self-distill", type=int, default=0,
                        help="extra rows of the target's own samples for the first N training captions")
    parser.add_argument("--self-distill-guidance", type=float, default=3.0)
    parser.add_argument("--self-distill-batch", type=int, default=100,
                        help="captions per generation call of the self-distilled rows (larger on a GPU)")
    parser.add_argument("--self-distill-greedy", action="store_true",
                        help="the self-distilled rows are the target's greedy (argmax) images, not temperature-1 samples")


def check_self_distill_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` for a batch below 1 or more rows than training captions."""
    if args.self_distill_batch < 1:
        parser.error(f"--self-distill-batch must be >= 1, got {args.self_distill_batch}")
    if not 0 <= args.self_distill <= args.train_images:
        parser.error(f"--self-distill must be in [0, --train-images={args.train_images}], got {args.self_distill}")


def self_distill_data(target: LlamaGenTransformer, words: torch.Tensor, guidance_scale: float, seed: int,
                      batch: int = 100, greedy: bool = False) -> dict[str, torch.Tensor]:
    """The target's own guided samples for the conditions ``words`` ``[N, C]``, temperature 1 or greedy
    (argmax), generated on the target's device: ``{"words": words, "tokens": [N, block_size]}`` on the CPU
    (deterministic for a seed)."""
    from mmspec.models.recipes.report_t2i import generate_tokens
    from mmspec.sampling import SamplingConfig

    generator = torch.Generator().manual_seed(seed)
    sampling = SamplingConfig(do_sample=not greedy)
    tokens = [generate_tokens(target, words[lo:lo + batch].to(target.device), guidance_scale, sampling, generator)
              for lo in range(0, words.shape[0], batch)]
    return {"words": words.cpu(), "tokens": torch.cat(tokens).cpu()}


def self_distilled_rows(args: argparse.Namespace, target: LlamaGenTransformer, words: torch.Tensor
                        ) -> dict[str, torch.Tensor]:
    """The ``--self-distill`` rows for the first of the training conditions ``words``, cached in the run's
    ``--work`` folder (``self_distill.pt``, or ``self_distill_greedy.pt``)."""
    return cached_data(args.work, lambda: self_distill_data(target, words[: args.self_distill], args.self_distill_guidance,
                                                       args.seed, batch=args.self_distill_batch,
                                                       greedy=args.self_distill_greedy),
                       name="self_distill_greedy.pt" if args.self_distill_greedy else "self_distill.pt",
                       key=args_key(args, "self_distill", "self_distill_guidance", "seed", "target"))
