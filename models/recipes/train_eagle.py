"""Recipe: the EAGLE draft head of the ``mmspec/shapes-t2i`` zoo entry.

Trains an :class:`~mmspec.models.eagle.EagleHead` on the frozen target's own features: each batch of
shapes-world images (the target's training data: same seed, difficulty and captions) is run through
the target with teacher forcing, and the head learns to predict the next top hidden state
(SmoothL1) and the target's next-token distribution (soft cross-entropy), :func:`eagle_loss`. 30% of
rows use the unconditional (dropped) condition, so the head also predicts the unconditional half of
classifier-free guidance: the pipeline drafts under guidance by running the head on both halves and
combining its logits like the target's. Deterministic; resumable.

``--self-distill N`` adds N rows whose image tokens the target itself sampled (temperature 1, guidance
``--self-distill-guidance``) for the first N training captions, generated once and cached in the work
folder. Teacher forcing on rendered images shows the head the data's token sequences, but at inference
it drafts continuations of the target's own guided samples, whose statistics differ (guidance sharpens
them); rows of the target's own samples train the head on the sequences it will be asked to continue
(the self-distillation of Medusa-2, EAGLE's regenerated data).

``--rollout-steps n`` trains drafting depths 1..n (EAGLE-3's training-time test, :func:`eagle_loss`):
at depth d the head continues from its own predicted features, as in a drafting chain, so acceptance
falls less with depth. Whatever n is, the report gives the head's agreement with the target on the
target's own greedy images over all slots (``own_greedy_top1``, condition slots included) and at
depths 1-4 of drafting chains over image-token slots only (``own_greedy_top1_depth1`` ...).

    python -m mmspec.models.recipes.train_eagle --target models/zoo/shapes-t2i/transformer \\
        --out models/zoo/shapes-t2i/eagle_head

``--num-future K`` trains a head that predicts K features per pair (FLASH's semi-autoregressive readout,
:class:`~mmspec.models.eagle.FutureReadout`), so the pipeline drafts K tokens per head forward; from a plain
head (``--init``) the readout starts as the identity. Its report gives every future's agreement on the
target's greedy images (``own_greedy_top1_future1`` ...). ``--freeze-head`` trains only the readout's
futures 2..K on the frozen ``--init`` head: its own prediction, which token-by-token drafting uses (the
pipeline's choice when sampling), stays that head's.

``--device cuda`` runs the frozen target, the self-distillation and the head on a GPU (data and random
draws stay on the CPU, so the run's random stream is the one a CPU run draws).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from mmspec.files import write_json_atomic
from mmspec.models.eagle import EagleHead
from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.recipes.common import (
    add_device_argument,
    add_run_arguments,
    args_key,
    cached_data,
    init_from_folder,
    start_run,
    step_generator,
    time_left,
    train_loop,
)
from mmspec.models.recipes.eagle_loss import eagle_loss
from mmspec.models.recipes.self_distill import (
    add_self_distill_arguments,
    check_self_distill_arguments,
    self_distill_data,
    self_distilled_rows,
)
from mmspec.models.recipes.train_t2i import build_data
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import VQTokenizer
from mmspec.sampling import apply_guidance
from mmspec.world import vocabulary


def eagle_batch(target: LlamaGenTransformer, words: torch.Tensor, tokens: torch.Tensor, drop: torch.Tensor,
                guidance: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Head inputs for a teacher-forced batch: ids ``[B, C+N-1]`` (-1 on condition positions), the
    target's top features there ``[B, C+N-1, d]`` and the valid mask (condition padding False), all on the
    target's device (the inputs may come from the CPU).

    ``guidance = s``: the features are the *guided* ones, ``h_u + s (h_c - h_u)`` of the conditional and
    unconditional passes (``drop`` is ignored), whose LM-head logits are exactly the guided logits."""
    words, tokens, drop = (t.to(target.device) for t in (words, tokens, drop))
    mask = (words >= 0).long()
    with torch.no_grad():
        if guidance is None:
            _, hidden = target.forward_train(words, tokens, drop, condition_mask=mask, return_hidden=True)
        else:
            both = torch.arange(2 * len(words), device=words.device) >= len(words)  # [cond; uncond]
            _, pair = target.forward_train(torch.cat([words, words]), torch.cat([tokens, tokens]), both,
                                           condition_mask=torch.cat([mask, mask]), return_hidden=True)
            hidden = apply_guidance(pair, guidance)
    ids = torch.cat([torch.full_like(words, -1), tokens[:, :-1]], 1)
    valid = torch.cat([mask.bool(), torch.ones_like(tokens[:, :-1], dtype=torch.bool)], 1)
    return ids, hidden.float(), valid


def init_head(head: EagleHead, folder: Path) -> None:
    """``--init``: the trained head saved in ``folder``. A plain head (``num_future`` 1) also starts a head
    with K futures: its layers are copied and the readout starts as the identity
    (:meth:`~mmspec.models.eagle.FutureReadout.start_as_identity`), so every future begins as the plain
    head's prediction."""
    if head.future is None or not (Path(folder) / "config.json").is_file() or \
            EagleHead.load_config(folder).get("num_future", 1) != 1:
        init_from_folder(head, EagleHead, folder, "EAGLE head")
        return
    plain = copy.deepcopy(head)
    plain.future = None
    init_from_folder(plain, EagleHead, folder, "EAGLE head")
    head.load_state_dict(plain.state_dict(), strict=False)
    head.future.start_as_identity()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the trained target transformer folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--feature-noise", type=float, default=0.2)
    parser.add_argument("--uncond-prob", type=float, default=0.3)
    add_self_distill_arguments(parser)
    parser.add_argument("--rollout-steps", type=int, default=1,
                        help="drafting depths trained (EAGLE-3 training-time test); 1 = teacher forcing only")
    parser.add_argument("--init", type=Path, default=None,
                        help="start from this trained head (a later training stage: fresh optimiser and schedule); "
                             "a plain head (num_future 1) also starts a --num-future head")
    parser.add_argument("--num-future", type=int, default=1, metavar="K",
                        help="features (tokens) the head predicts per pair, FLASH's semi-autoregressive readout: "
                             "K drafts per head forward (1: the plain EAGLE head)")
    parser.add_argument("--freeze-head", action="store_true",
                        help="with --num-future and --init: train only the readout's futures 2..K on the frozen "
                             "--init head, so its own next-feature prediction (token-by-token drafting) stays exact")
    parser.add_argument("--guided-features", type=float, default=None, metavar="S",
                        help="train on the target's guided features h_u + S (h_c - h_u) (a head that drafts the "
                             "guided target from one row; needs --uncond-prob 0)")
    add_run_arguments(parser, "runs/train_eagle")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if args.rollout_steps < 1:
        parser.error(f"--rollout-steps must be >= 1, got {args.rollout_steps}")
    check_self_distill_arguments(parser, args)
    if args.num_future < 1:
        parser.error(f"--num-future must be >= 1, got {args.num_future}")
    if args.num_future > 1 and args.rollout_steps > 1:
        parser.error("--rollout-steps trains token-by-token drafting depths; a --num-future head drafts blocks")
    if args.freeze_head and (args.num_future < 2 or args.init is None):
        parser.error("--freeze-head trains the readout of a --num-future K > 1 head on a frozen --init head")
    if args.guided_features is not None and args.uncond_prob != 0:
        parser.error("--guided-features trains on guided features only: pass --uncond-prob 0")
    start_run(args)

    device = torch.device(args.device)
    target = LlamaGenTransformer.from_pretrained(args.target).float().eval().requires_grad_(False).to(device)
    vq = VQTokenizer.from_pretrained(args.vq)
    words = WordTokenizer(vocabulary())
    cond_len = target.config.cls_token_num
    data = cached_data(args.work, lambda: build_data(args.train_images, args.seed, vq, words, cond_len,
                                                     args.difficulty, workers=args.data_workers),
                       key=args_key(args, "train_images", "seed", "difficulty", "vq", cond_len=cond_len))
    if args.self_distill:
        own = self_distilled_rows(args, target, data["words"])
        data = {key: torch.cat([data[key], own[key]]) for key in ("words", "tokens")}

    head = EagleHead(hidden_size=target.config.dim, vocab_size=target.config.vocab_size,
                     num_attention_heads=args.heads, feature_guidance=args.guided_features,
                     num_future=args.num_future)
    if args.init is not None and not (args.work / "checkpoint.pt").is_file():  # a resumed run restores its own
        init_head(head, args.init)
    head.bind_target(target.get_input_embeddings(), target.get_output_embeddings())
    if args.freeze_head:  # only the readout learns; future 1 stays the plain head's prediction
        head.requires_grad_(False)
        head.future.requires_grad_(True)

    def loss_fn(index: torch.Tensor) -> torch.Tensor:
        drop = torch.rand(len(index)) < args.uncond_prob
        ids, hidden, valid = eagle_batch(target, data["words"][index], data["tokens"][index], drop,
                                         args.guided_features)
        return eagle_loss(head, ids, hidden, valid, feature_noise=args.feature_noise, generator=step_generator(),
                          rollout_steps=args.rollout_steps, train_first_future=not args.freeze_head)["loss"]

    def save(model: EagleHead) -> None:
        copy.deepcopy(model).eval().to("cpu").save_pretrained(args.out)

    train_loop(head, loss_fn, data["tokens"].shape[0], steps=args.steps, batch=args.batch, lr=args.lr,
               work=args.work, save=save, weight_decay=0.0, stop_at=args.stop_at, device=device,
               time_limit=time_left(args))

    # held-out agreement of the head's argmax with the target's (a proxy for acceptance)
    val = build_data(512, args.seed, vq, words, target.config.cls_token_num, args.difficulty, split="val")
    ids, hidden, valid = eagle_batch(target, val["words"], val["tokens"], torch.zeros(512, dtype=torch.bool),
                                     args.guided_features)
    with torch.no_grad():
        result = eagle_loss(head, ids, hidden, valid)
    report = {k: round(float(v), 4) for k, v in result.items()}
    # the same on the target's own guided greedy images for 256 of those captions (the sequences a greedy
    # run asks the head to continue), at drafting depths 1-4 (chains of the head's own features)
    own = self_distill_data(target, val["words"][:256], args.self_distill_guidance, args.seed, greedy=True)
    ids, hidden, valid = eagle_batch(target, own["words"], own["tokens"], torch.zeros(256, dtype=torch.bool),
                                     args.guided_features)
    with torch.no_grad():
        deep = eagle_loss(head, ids, hidden, valid, rollout_steps=4 if head.future is None else 1)
    report["own_greedy_top1"] = round(float(deep["top1"]), 4)
    report.update({f"own_greedy_{key}": round(float(value), 4) for key, value in deep.items()
                   if key.startswith(("top1_depth", "top1_future"))})
    write_json_atomic((args.work / "report.json"), report, indent=None)
    print("held-out", json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
