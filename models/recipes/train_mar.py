"""Recipe: the MAR target and draft models of the ``mmspec/shapes-t2i-continuous`` zoo entry.

A text-conditioned :class:`~mmspec.models.mar.MARModel` trained with MAR's objective (random order,
truncated-Gaussian masking ratio >= ``--mask-ratio-min``, diffusion loss on the masked tokens, 10 %
condition dropout for classifier-free guidance) on shapes-world images of the six GenEval categories,
encoded by the zoo's continuous tokenizer (64 tokens x 16 channels per 32x32 image). Word ids fill the
model's condition buffer (``--cond-len`` slots, no T5). The deliverable is the EMA of the weights
(``--ema``), saved in fp16 (the pipeline computes in fp32). Deterministic for a seed; resumable: rerun
the same command after an interruption (checkpoints every ``--save-every`` steps under ``--work``).
``--init FOLDER`` starts a later stage from a trained model (fresh optimiser and schedule).

    python -m mmspec.models.recipes.train_mar --role target --out runs/mar_target/model
    python -m mmspec.models.recipes.train_mar --role draft --out runs/mar_draft/model

``--distill-from TARGET`` (with ``--distill-weight``) also trains the model to match a frozen target's
diffusion-head outputs (:func:`~mmspec.models.recipes.mar_loss.mar_loss`'s ``teacher``), for a CSpD draft;
what it did to CSpD's acceptance on the zoo is in docs/pipeline_continuous.md.

``--role`` picks the size preset (:data:`PRESETS`); any size flag overrides it. Run long jobs in the
background (``nohup nice -n 10 ... > runs/<name>.out 2>&1 &``).
"""

from __future__ import annotations

import argparse
import copy
from functools import partial
from pathlib import Path

import torch
from torch import nn

from mmspec.models.mar import MARModel
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
from mmspec.models.recipes.mar_loss import mar_loss
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import ContinuousTokenizer, zoo_tokenizer_path
from mmspec.world import vocabulary

GENEVAL_CATEGORIES = {c: 1.0 for c in ("single_object", "two_object", "counting", "colors", "position", "color_attr")}

#: Model sizes and schedules of the two zoo models (chosen by short prototypes: see
#: docs/pipeline_continuous.md); every field can be overridden on the command line.
PRESETS: dict[str, dict] = {
    "target": dict(dim=160, encoder_depth=4, decoder_depth=4, heads=4, head_depth=3, head_width=192,
                   steps=4000, batch=32, lr=1e-3),
    "draft": dict(dim=128, encoder_depth=1, decoder_depth=1, heads=4, head_depth=2, head_width=128,
                  steps=3000, batch=32, lr=1e-3),
}


def build_data(num: int, seed: int, tokenizer: ContinuousTokenizer, words: WordTokenizer, cond_len: int,
               difficulty: float, workers: int = 1) -> dict[str, torch.Tensor]:
    """Render, encode and caption ``num`` scenes: ``{"tokens": [N, 64, 16] fp16, "words": [N, cond_len]}``
    (``workers`` processes: :func:`~mmspec.models.recipes.common.encode_image_set`)."""
    tokens, captions = encode_image_set(num, seed, partial(_encode_tokens, tokenizer), difficulty,
                                        categories=GENEVAL_CATEGORIES, workers=workers)
    return {"tokens": tokens, "words": words.batch(captions, cond_len), "captions": captions}


def _encode_tokens(tokenizer: ContinuousTokenizer, images: torch.Tensor) -> torch.Tensor:
    """The tokenizer's latents of ``images`` as the model's token rows ``[B, 64, 16]``, fp16."""
    return tokenizer.encode(images).flatten(1, 2).to(torch.float16)


class EMATrainer(nn.Module):
    """The trained model plus an exponential moving average of its parameters held as buffers, so the
    shared :func:`train_loop` checkpoints (and resumes) both while optimising only the model. The decay
    warms up as min(decay, (1 + n) / (10 + n)) after n updates, so early checkpoints are usable too."""

    def __init__(self, model: MARModel, decay: float) -> None:
        super().__init__()
        self.model = model
        self.decay = decay
        self.register_buffer("ema_updates", torch.zeros((), dtype=torch.long))
        for i, (_, param) in enumerate(model.named_parameters()):
            self.register_buffer(f"ema_{i}", param.detach().clone())

    @torch.no_grad()
    def update(self) -> None:
        n = int(self.ema_updates)
        decay = min(self.decay, (1 + n) / (10 + n))
        for i, param in enumerate(self.model.parameters()):
            getattr(self, f"ema_{i}").lerp_(param.detach(), 1.0 - decay)
        self.ema_updates += 1

    def averaged(self) -> MARModel:
        """A copy of the model carrying the averaged weights."""
        out = copy.deepcopy(self.model)
        with torch.no_grad():
            for i, param in enumerate(out.parameters()):
                param.copy_(getattr(self, f"ema_{i}"))
        return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the trained model (save_pretrained)")
    parser.add_argument("--role", choices=list(PRESETS), default="target")
    for name, kind in (("dim", int), ("encoder-depth", int), ("decoder-depth", int), ("heads", int),
                       ("head-depth", int), ("head-width", int), ("steps", int), ("batch", int), ("lr", float)):
        parser.add_argument(f"--{name}", type=kind, default=None, help="overrides the --role preset")
    parser.add_argument("--cond-len", type=int, default=12, help="condition buffer slots (words)")
    parser.add_argument("--mask-ratio-min", type=float, default=0.5,
                        help="MAR uses 0.7; lower shows the model denser contexts (later iterations)")
    parser.add_argument("--prediction-type", choices=("epsilon", "v_prediction"), default="v_prediction",
                        help="what the head predicts (MAR: epsilon)")
    parser.add_argument("--normal-pos-init", action="store_true",
                        help="MAR's N(0, 0.02) position tables instead of the sin-cos start")
    parser.add_argument("--diffusion-batch-mul", type=int, default=2)
    parser.add_argument("--num-sampling-steps", type=int, default=25, help="default DDPM steps at generation")
    parser.add_argument("--clip-denoised", type=float, default=7.0,
                        help="x0 bound of the sampler saved in the config (latents lie in [-6.6, 5.4])")
    parser.add_argument("--ema", type=float, default=0.999, help="EMA decay of the saved weights (0: last weights)")
    parser.add_argument("--save-every", type=int, default=250)
    parser.add_argument("--init", type=Path, default=None,
                        help="start from this trained model folder (a later stage with a fresh schedule; the EMA "
                             "starts from its weights too)")
    parser.add_argument("--distill-from", type=Path, default=None,
                        help="a trained model folder (the CSpD target) whose diffusion-head outputs this model also "
                             "learns to match (mar_loss's teacher)")
    parser.add_argument("--distill-weight", type=float, default=1.0, help="weight of the matching loss")
    parser.add_argument("--tokenizer", type=Path, default=zoo_tokenizer_path("continuous"))
    add_run_arguments(parser, "runs/train_mar")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    preset = PRESETS[args.role]
    size = {key: getattr(args, key) if getattr(args, key) is not None else preset[key] for key in preset}
    start_run(args)

    tokenizer = ContinuousTokenizer.from_pretrained(args.tokenizer)
    words = WordTokenizer(vocabulary())
    data = cached_data(args.work, lambda: build_data(args.train_images, args.seed, tokenizer, words, args.cond_len,
                                                     args.difficulty, workers=args.data_workers),
                       key=args_key(args, "train_images", "seed", "cond_len", "difficulty", "tokenizer"))
    grid = int(round(data["tokens"].shape[1] ** 0.5))
    model = MARModel(grid_size=grid, token_dim=data["tokens"].shape[2], encoder_embed_dim=size["dim"],
                     encoder_depth=size["encoder_depth"], encoder_num_heads=size["heads"],
                     decoder_embed_dim=size["dim"], decoder_depth=size["decoder_depth"],
                     decoder_num_heads=size["heads"], buffer_size=args.cond_len, condition_type="text",
                     text_vocab_size=len(words), label_drop_prob=0.1, mask_ratio_min=args.mask_ratio_min,
                     diffloss_d=size["head_depth"], diffloss_w=size["head_width"],
                     num_sampling_steps=args.num_sampling_steps, diffusion_batch_mul=args.diffusion_batch_mul,
                     clip_denoised=args.clip_denoised, sincos_init=not args.normal_pos_init,
                     prediction_type=args.prediction_type)
    if args.init is not None and not (args.work / "checkpoint.pt").is_file():  # a resumed run restores its own
        init_from_folder(model, MARModel, args.init, "MAR model")
    teacher = load_teacher(args.distill_from, model, len(words), args.distill_weight)
    trainer = EMATrainer(model, args.ema)
    out = Path(args.out)

    def save(trained: EMATrainer) -> None:
        save_fp16_copy(trained.averaged() if args.ema > 0 else trained.model, out)  # copies before the cast
        words.save(out / "text_vocab.json")

    device = torch.device(args.device)
    if teacher is not None:
        teacher.to(device)

    def loss_fn(index: torch.Tensor) -> torch.Tensor:
        if args.ema > 0:
            trainer.update()  # average of the weights after the previous step
        return mar_loss(model, data["tokens"][index].to(device).float(), data["words"][index].to(device),
                        teacher=teacher, distill_weight=args.distill_weight)

    train_loop(trainer, loss_fn, data["tokens"].shape[0], steps=size["steps"], batch=size["batch"], lr=size["lr"],
               work=args.work, save=save, save_every=args.save_every, stop_at=args.stop_at, device=device,
               time_limit=time_left(args))


def load_teacher(folder: Path | None, student: MARModel, vocab_size: int, weight: float) -> MARModel | None:
    """The frozen ``--distill-from`` model (float32, eval mode), checked against the student: the same token
    width and word vocabulary (its outputs are matched on the student's inputs). None without a folder."""
    if folder is None:
        return None
    if not weight > 0:
        raise ValueError(f"--distill-weight must be > 0, got {weight}")
    if not (Path(folder) / "config.json").is_file():
        raise FileNotFoundError(f"--distill-from: no trained MAR model at {folder}")
    teacher = MARModel.from_pretrained(folder).float().eval().requires_grad_(False)
    for name, mine, theirs in (("token_dim", student.config.token_dim, teacher.config.token_dim),
                               ("text_vocab_size", vocab_size, teacher.config.text_vocab_size),
                               ("buffer_size", student.config.buffer_size, teacher.config.buffer_size),
                               ("grid_size", student.config.grid_size, teacher.config.grid_size)):
        if mine != theirs:
            raise ValueError(f"--distill-from {folder}: its {name} is {theirs}, this model's {mine}")
    return teacher


if __name__ == "__main__":
    main()
