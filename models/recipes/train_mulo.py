"""Recipe: the MuLo-SD drafter of the ``mmspec/shapes-t2i`` zoo entry.

Trains, on the same shapes-world data as the target (same seed, difficulty and captions):

1. ``mulo_drafter``: a small t2i :class:`~mmspec.models.llamagen.LlamaGenTransformer` over the 4x4 token
   grid of the image at half resolution (16x16 pixels), with the target's word table layout and
   condition length, so it reads the same prompt inputs (and runs under the same guidance);
2. ``mulo_upsampler``: a :class:`~mmspec.models.mulo.TokenUpsampler` from the low-res grid to the
   target's 8x8 grid.

Low-res tokens are :func:`~mmspec.models.mulo.downsample_tokens` of the high-res ones, exactly what the
pipeline feeds the drafter at inference. Deterministic; resumable per part (``--work``/drafter,
``--work``/upsampler).

    python -m mmspec.models.recipes.train_mulo --out models/zoo/shapes-t2i

A later stage starts both parts from a trained pair (``--init FOLDER``, a pipeline folder with
``mulo_drafter/`` and ``mulo_upsampler/``; fresh optimiser and schedule, ``--seed`` for a newly rendered
set), and ``--self-distill N --target FOLDER`` adds N rows of the target's own guided samples
(:mod:`~mmspec.models.recipes.self_distill`): at inference the drafter continues, and the up-sampler
refines, the target's images, not rendered ones.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.mulo import TokenUpsampler, downsample_tokens
from mmspec.models.recipes.common import (
    add_run_arguments,
    args_key,
    cached_data,
    init_from_folder,
    save_fp16_copy,
    start_run,
    train_loop,
)
from mmspec.models.recipes.self_distill import (
    add_self_distill_arguments,
    check_self_distill_arguments,
    self_distilled_rows,
)
from mmspec.models.recipes.train_t2i import build_data
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import VQTokenizer
from mmspec.world import vocabulary


def low_res_tokens(vq: VQTokenizer, tokens: torch.Tensor, ratio: int) -> torch.Tensor:
    """``[N, H*W]`` high-res tokens -> ``[N, (H/r)*(W/r)]`` low-res tokens, in chunks."""
    grid = int(round(tokens.shape[1] ** 0.5))
    out = [downsample_tokens(vq, chunk.view(-1, grid, grid), ratio).flatten(1) for chunk in tokens.split(2000)]
    return torch.cat(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="pipeline folder (gets mulo_drafter/, mulo_upsampler/)")
    parser.add_argument("--part", choices=("all", "drafter", "upsampler"), default="all")
    parser.add_argument("--ratio", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--cond-len", type=int, default=32, help="must equal the target's cls_token_num")
    parser.add_argument("--drafter-steps", type=int, default=3000)
    parser.add_argument("--upsampler-steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--high-res-context", action="store_true",
                        help="an up-sampler that also reads the final high-res rows above each block "
                             "(TokenUpsampler(high_res_context=True))")
    parser.add_argument("--init", type=Path, default=None,
                        help="start both parts from the trained pair in this pipeline folder (a later stage: "
                             "fresh optimiser and schedule)")
    parser.add_argument("--target", type=Path, default=None,
                        help="the trained target transformer folder (needed by --self-distill)")
    add_self_distill_arguments(parser)
    add_run_arguments(parser, "runs/train_mulo")
    args = parser.parse_args(argv)
    check_self_distill_arguments(parser, args)
    if args.self_distill and args.target is None:
        parser.error("--self-distill samples the target's own images: pass --target")
    start_run(args)

    vq = VQTokenizer.from_pretrained(args.vq)
    words = WordTokenizer(vocabulary())
    def build() -> dict:
        data = build_data(args.train_images, args.seed, vq, words, args.cond_len, args.difficulty,
                          workers=args.data_workers)
        return {**data, "low_tokens": low_res_tokens(vq, data["tokens"], args.ratio)}

    data = cached_data(args.work, build,
                       key=args_key(args, "train_images", "seed", "cond_len", "difficulty", "ratio", "vq"))
    if args.self_distill:
        target = LlamaGenTransformer.from_pretrained(args.target).float().eval().requires_grad_(False)
        if target.config.cls_token_num != args.cond_len or target.config.vocab_size != vq.vocab_size:
            raise ValueError(f"--target {args.target}: condition length {target.config.cls_token_num} and vocabulary "
                             f"{target.config.vocab_size}, the recipe {args.cond_len} and {vq.vocab_size}")
        own = self_distilled_rows(args, target, data["words"])
        own["low_tokens"] = low_res_tokens(vq, own["tokens"], args.ratio)
        data = {key: torch.cat([data[key], own[key]]) for key in ("words", "tokens", "low_tokens")}
    high, low, cond = data["tokens"], data["low_tokens"], data["words"]
    grid, low_grid = int(round(high.shape[1] ** 0.5)), int(round(low.shape[1] ** 0.5))
    if grid != low_grid * args.ratio:
        raise ValueError(f"cached data in {args.work / 'data.pt'} has grids {grid} and {low_grid}, not ratio {args.ratio}: "
                         "use a fresh --work")

    if args.part in ("all", "drafter"):
        torch.manual_seed(args.seed)
        drafter = LlamaGenTransformer(dim=args.dim, n_layer=args.layers, n_head=args.heads, multiple_of=32,
                                      model_type="t2i", vocab_size=vq.vocab_size, block_size=low.shape[1],
                                      cls_token_num=args.cond_len, caption_dim=args.dim, text_vocab_size=len(words),
                                      class_dropout_prob=0.1, condition_rope="identity")
        if args.init is not None:
            init_from_folder(drafter, LlamaGenTransformer, args.init / "mulo_drafter", "MuLo drafter")

        def drafter_loss(index: torch.Tensor) -> torch.Tensor:
            c, t = cond[index], low[index]
            logits = drafter.forward_train(c, t, condition_mask=(c >= 0).long())
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten())

        def save_drafter(model: LlamaGenTransformer) -> None:
            save_fp16_copy(model, args.out / "mulo_drafter")

        train_loop(drafter, drafter_loss, low.shape[0], steps=args.drafter_steps, batch=args.batch, lr=args.lr,
                   work=args.work / "drafter", save=save_drafter)

    if args.part in ("all", "upsampler"):
        torch.manual_seed(args.seed)
        upsampler = TokenUpsampler(vocab_size=vq.vocab_size, ratio=args.ratio, dim=args.dim,
                                   high_res_context=args.high_res_context)
        if args.init is not None:
            init_from_folder(upsampler, TokenUpsampler, args.init / "mulo_upsampler", "MuLo up-sampler")

        def upsampler_loss(index: torch.Tensor) -> torch.Tensor:
            context = high[index].view(-1, grid, grid) if args.high_res_context else None
            logits = upsampler(low[index].view(-1, low_grid, low_grid), context)  # [b, H, W, V]
            return torch.nn.functional.cross_entropy(logits.flatten(0, 2), high[index].flatten())

        def save_upsampler(model: TokenUpsampler) -> None:
            save_fp16_copy(model, args.out / "mulo_upsampler")

        train_loop(upsampler, upsampler_loss, high.shape[0], steps=args.upsampler_steps, batch=args.batch,
                   lr=args.lr, work=args.work / "upsampler", save=save_upsampler, weight_decay=0.0)


if __name__ == "__main__":
    main()
