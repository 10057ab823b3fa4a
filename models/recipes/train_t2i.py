"""Recipe: the text-to-image target of the ``mmspec/shapes-t2i`` zoo entry.

A LlamaGen-compatible t2i transformer (8 layers, d=192 by default) trained on shapes-world images with
GenEval-template captions, tokenized by the zoo's VQ tokenizer (64 tokens per 32x32 image). Word ids
are embedded by the model's own text table (no T5). Deterministic for a seed; resumable: checkpoints
every ``--save-every`` steps under ``--work``, logs JSON lines.

    python -m mmspec.models.recipes.train_t2i --out models/zoo/shapes-t2i/transformer

Run long jobs in the background (``nohup ... &``); rerunning the same command resumes. ``--init FOLDER``
starts a later stage from a trained target (same architecture) with a fresh schedule, e.g. on new images
(``--seed``):

    python -m mmspec.models.recipes.train_t2i --init models/zoo/shapes-t2i/transformer --seed 1 \
        --lr 5e-4 --work runs/train_t2i_stage2 --out runs/train_t2i_stage2/transformer
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.recipes.common import (
    add_device_argument,
    add_run_arguments,
    args_key,
    cached_data,
    encode_image_set,
    init_from_folder,
    save_fp16_copy,
    start_run,
    time_left,
    train_loop,
)
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import VQTokenizer
from mmspec.world import vocabulary


def build_data(num: int, seed: int, vq: VQTokenizer, words: WordTokenizer, cond_len: int,
               difficulty: float, split: str = "train", workers: int = 1) -> dict[str, torch.Tensor]:
    """Render, tokenize and caption ``num`` scenes: ``{"tokens": [N, 64], "words": [N, cond_len]}``
    (``workers`` processes: :func:`~mmspec.models.recipes.common.encode_image_set`)."""
    tokens, captions = encode_image_set(num, seed, partial(_encode_tokens, vq), difficulty, split=split,
                                        workers=workers)
    return {"tokens": tokens, "words": words.batch(captions, cond_len), "captions": captions}


def _encode_tokens(vq: VQTokenizer, images: torch.Tensor) -> torch.Tensor:
    """The VQ codes of ``images`` in raster order, ``[B, 64]``."""
    return vq.encode(images).flatten(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--cond-len", type=int, default=32)
    parser.add_argument("--condition-rope", choices=("zero", "identity"), default="identity")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--init", type=Path, default=None,
                        help="start from this trained target folder (a later stage with a fresh schedule)")
    add_run_arguments(parser, "runs/train_t2i")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    start_run(args)

    vq = VQTokenizer.from_pretrained(args.vq)
    words = WordTokenizer(vocabulary())
    data = cached_data(args.work, lambda: build_data(args.train_images, args.seed, vq, words, args.cond_len,
                                                     args.difficulty, workers=args.data_workers),
                       key=args_key(args, "train_images", "seed", "cond_len", "difficulty", "vq"))
    grid_tokens = data["tokens"].shape[1]

    model = LlamaGenTransformer(dim=args.dim, n_layer=args.layers, n_head=args.heads, multiple_of=32,
                                model_type="t2i", vocab_size=vq.vocab_size, block_size=grid_tokens,
                                cls_token_num=args.cond_len, caption_dim=args.dim, text_vocab_size=len(words),
                                class_dropout_prob=0.1, condition_rope=args.condition_rope)
    if args.init is not None and not (args.work / "checkpoint.pt").is_file():  # a resumed run restores its own
        init_from_folder(model, LlamaGenTransformer, args.init, "target")
    out = Path(args.out)

    def save(trained: LlamaGenTransformer) -> None:
        save_fp16_copy(trained, out)
        words.save(out / "text_vocab.json")

    device = torch.device(args.device)

    def loss_fn(index: torch.Tensor) -> torch.Tensor:
        cond, tokens = data["words"][index].to(device), data["tokens"][index].to(device)
        logits = model.forward_train(cond, tokens, condition_mask=(cond >= 0).long())
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    train_loop(model, loss_fn, data["tokens"].shape[0], steps=args.steps, batch=args.batch, lr=args.lr,
               work=args.work, save=save, save_every=args.save_every, stop_at=args.stop_at, device=device,
               time_limit=time_left(args))


if __name__ == "__main__":
    main()
