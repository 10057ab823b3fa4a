"""Recipe: the target and the standalone draft captioner of the ``mmspec/shapes-vlm`` zoo entry.

Trains a ``LlavaForConditionalGeneration`` of :func:`mmspec.models.shapes_vlm.shapes_vlm_config` from
scratch on CPU on the shapes world: detailed descriptions, short captions and question answering on
64x64 images, narrations and captions of 4-frame videos (see :mod:`mmspec.models.shapes_vlm`). Only the
answer tokens (and ``</s>``) are in the loss. Deterministic for a seed and thread count; resumable:
the training set is rendered once into ``--work/data.pt``, checkpoints go to ``--work/checkpoint.pt``
every ``--save-every`` steps and the loss to ``--work/log.jsonl``; rerunning the same command continues.
The deliverable (fp16 safetensors, generation config, processor) is written to ``--out`` at every save.

    python -m mmspec.models.recipes.train_vlm --size target --out models/zoo/shapes-vlm/target
    python -m mmspec.models.recipes.train_vlm --size draft --out models/zoo/shapes-vlm/draft

Run long jobs in the background (``nohup ... &``).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from mmspec.models import shapes_vlm as sv
from mmspec.models.recipes.common import add_run_arguments, cached_data, start_run, train_loop

# Per size: steps, batch, peak learning rate (chosen with short prototype runs; see docs/zoo_shapes_vlm.md).
DEFAULTS: dict[str, dict] = {
    "target": dict(steps=1500, batch=32, lr=1e-3),
    "draft": dict(steps=1500, batch=32, lr=2e-3),
    "tiny": dict(steps=20, batch=4, lr=1e-3),
}


def chunks_by_length(data: dict, rows: list[int], max_tokens: int) -> list[list[int]]:
    """Split ``rows`` into micro-batches of similar length (sorted by length, then cut so that a chunk's
    padded size ``rows x longest`` stays within ``max_tokens``): long video prompts and one-word answers
    do not pad each other."""
    rows = sorted(rows, key=lambda r: (len(data["examples"][r]["ids"]), r))
    out, current = [], []
    for r in rows:
        longest = len(data["examples"][r]["ids"])  # sorted: the newest row is the longest
        if current and (len(current) + 1) * longest > max_tokens:
            out.append(current)
            current = []
        current.append(r)
    if current:
        out.append(current)
    return out


def make_loss_fn(model, data: dict, max_tokens: int = 4096):
    """``loss_fn(indices)`` for :func:`train_loop`: mean cross-entropy per answer token over the batch."""

    def loss_fn(index: torch.Tensor) -> torch.Tensor:
        total, count = 0.0, 0
        for rows in chunks_by_length(data, index.tolist(), max_tokens):
            loss, n = sv.answer_loss(model, sv.training_batch(data, rows))
            total, count = total + loss, count + n
        return total / max(count, 1)

    return loss_fn


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=tuple(sv.MODEL_SIZES), default="target")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=None, help="default: per size (DEFAULTS)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--train-videos", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per micro-batch")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=INT",
                        help="model size entries to change, e.g. text_dim=192 text_layers=6")
    add_run_arguments(parser, "")
    parser.set_defaults(train_images=24000, difficulty=sv.DIFFICULTY)
    args = parser.parse_args(argv)
    for key in ("steps", "batch", "lr"):
        if getattr(args, key) is None:
            setattr(args, key, DEFAULTS[args.size][key])
    if str(args.work) in ("", "."):
        args.work = Path(f"runs/train_vlm_{args.size}")
    overrides = {}
    for item in args.override:
        key, _, value = item.partition("=")
        if not value.isdigit():
            raise ValueError(f"--override takes KEY=INT entries, got {item!r}")
        overrides[key] = int(value)
    start_run(args)

    processor = sv.build_processor()
    data = cached_data(args.work, lambda: sv.build_training_set(args.train_images, args.train_videos, args.seed,
                                                                "train", difficulty=args.difficulty,
                                                                tokenizer=processor.tokenizer))
    model = sv.build_model(args.size, seed=args.seed, **overrides)
    out = Path(args.out)

    def save(trained) -> None:
        copy.deepcopy(trained).eval().to(torch.float16).save_pretrained(out)  # fp16 keeps the zoo small
        processor.save_pretrained(out)

    train_loop(model, make_loss_fn(model, data, args.max_tokens), len(data["examples"]), steps=args.steps,
               batch=args.batch, lr=args.lr, work=args.work, save=save, save_every=args.save_every)


if __name__ == "__main__":
    main()
