"""Recipe: the target and the drafter of the ``mmspec/shapes-video`` zoo entry.

Both are :class:`~mmspec.models.video.BlockCausalVideoTransformer` models (block-causal latent video
diffusion, Self-Forcing / CausVid style) trained by teacher forcing with the flow-matching loss on
shapes-world videos: 16 frames of 32x32 (1-2 moving objects), encoded per frame by the zoo's continuous
patch tokenizer (8x8x16 latents), blocks of 2 frames, captions in the video-prompt format ("a red circle
moving right and a blue square moving up"). The two roles differ only in size:

    python -m mmspec.models.recipes.train_video --role target --out runs/train_video_target/model
    python -m mmspec.models.recipes.train_video --role drafter --out runs/train_video_drafter/model

**Why a second stage.** Teacher forcing gives every block the same weight, and all blocks but the first
can copy their objects from the clean context: after the first stage (1900 steps) the first block's
flow-matching loss at t = 750 was about four times the others' and only 10 % lower with the right prompt
than with the null prompt (``report_video block-loss``; the model had learnt to move objects, not to draw
the prompt's). The second stage starts from the first stage's
model (``--init``) and adds, at every step, a batch of first blocks alone (``--first-block-batch``; a
block without context is about a ninth of a clip's tokens) drawn from extra clips rendered for their
first block only (``--first-block-clips``, same start-position distribution as the full clips):

    python -m mmspec.models.recipes.train_video --role target --steps 800 --out runs/train_video_target/model
    python -m mmspec.models.recipes.train_video --role target --steps 3000 --stop-at 1900 \
        --out runs/train_video_target/model
    python -m mmspec.models.recipes.train_video --role target --init runs/train_video_target/model \
        --first-block-batch 64 --steps 1500 --work runs/train_video_target_fb --out runs/train_video_target_fb/model

**Reflow drafter** (``--reflow-from TARGET``): the drafter is trained on the target's own videos instead of
the data: ``--reflow-clips`` prompts (the training clips' captions) sampled by the target as the pipeline's
``method="none"`` does (4 Euler steps, ``--reflow-guidance``), each block kept with the noise it started from
(:func:`~mmspec.models.video.sample_with_noise`); the loss is flow matching on that coupling
(``noise=``), per-block timesteps from ``--reflow-timesteps`` (the drafter's schedule) for a
``--fixed-fraction`` of blocks. The straight noise-to-target-block paths let a one- or two-step drafter
(``ARVideoPipeline(..., draft_num_inference_steps=1)``) land near the block the target would make of the
same noise, and the target's guidance is distilled in (the drafter runs unguided):

    python -m mmspec.models.recipes.train_video --role drafter --init models/zoo/shapes-video/drafter \
        --reflow-from models/zoo/shapes-video/transformer --reflow-clips 4000 --reflow-timesteps 1000 \
        --fixed-fraction 0.75 --condition-dropout 0 --train-clips 4000 --steps 1500 --lr 3e-4 \
        --work runs/vid_reflow --out runs/vid_reflow/model

Deterministic for a seed; resumable (rerun the same command): checkpoints every ``--save-every`` steps
under ``--work``, JSON-lines log in ``--work/log.jsonl``. The training clips are rendered and encoded
once and cached in ``--work/data.pt`` (``--data`` reuses another run's file, e.g. the target's for the
drafter). Run it in the background (``nohup nice -n 10 ... &``).
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from mmspec.models.recipes.common import (
    add_data_workers_argument,
    add_device_argument,
    args_key,
    cached_data,
    save_fp16_copy,
    start_run,
    time_left,
    train_loop,
)
from mmspec.models.recipes.video_loss import check_context_shares, flow_matching_loss
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import ContinuousTokenizer, zoo_tokenizer_path
from mmspec.models.video import (
    DEFAULT_TIMESTEPS,
    BlockCausalVideoTransformer,
    check_timesteps,
    sample_with_noise,
)
from mmspec.world import render_scene, rng_for, sample_video, vocabulary
from mmspec.world.parallel import build_in_parts, concat_parts
from mmspec.world.video import MotionSpec, VideoClip, video_prompt_text

#: sizes of the two roles; a drafter pass costs about a quarter of a target pass on CPU (2 layers vs 8)
ROLES = {"target": {"dim": 128, "layers": 8, "heads": 4}, "drafter": {"dim": 128, "layers": 2, "heads": 4}}
TEXT_VOCAB_FILE = "text_vocab.json"
FIRST_BLOCK_INDEX = 10**7  # first-block-only clips come from this index of the training stream on
DIFFICULTY = 0.5  # rendering difficulty of the training clips (background tint, pixel noise)


def clip_caption(clip: VideoClip) -> str:
    """The clip's objects in the video-prompt format (no sizes), as ``make_video_prompt_set`` writes them."""
    return video_prompt_text([MotionSpec(o.shape, o.color, d) for o, d in zip(clip.objects, clip.directions)])


def build_data(num: int, seed: int, tokenizer: ContinuousTokenizer, words: WordTokenizer, text_length: int,
               num_frames: int, difficulty: float, max_objects: int = 2, split: str = "train",
               first_index: int = 0, render_frames: int | None = None, workers: int = 1) -> dict:
    """Render, encode and caption ``num`` clips (indices ``first_index`` on of the ``split`` stream):
    ``{"latents": [N, F, C, h, w] fp16, "words": [N, L], "captions"}``. Clips are sampled with
    ``num_frames`` frames (start positions leave room for the whole motion); only the first
    ``render_frames`` (default all) are rendered and encoded. ``workers`` > 1 builds slices of the clips in
    that many processes (:func:`~mmspec.world.parallel.build_in_parts`)."""
    parts = build_in_parts(partial(_clips, seed=seed, tokenizer=tokenizer, num_frames=num_frames,
                                   difficulty=difficulty, max_objects=max_objects, split=split,
                                   first_index=first_index, render_frames=render_frames), num, workers)
    data = concat_parts(parts)
    return {**data, "words": words.batch(data["captions"], text_length)}


def _clips(first: int, count: int, *, seed: int, tokenizer: ContinuousTokenizer, num_frames: int, difficulty: float,
           max_objects: int, split: str, first_index: int, render_frames: int | None) -> dict:
    """Clips ``first .. first + count - 1`` of :func:`build_data`: ``latents`` and ``captions``."""
    latents, captions = [], []
    start = time.time()
    for index in range(first, first + count):
        rng = rng_for(split, seed, first_index + index)
        clip = sample_video(rng, int(rng.integers(1, max_objects + 1)), num_frames)
        frames = np.stack([render_scene(clip.scene_at(t), tokenizer.config.image_size, difficulty, frame=t)
                           for t in range(render_frames or num_frames)])
        with torch.no_grad():
            z = tokenizer.encode(torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255.0)  # [F, h, w, C]
        latents.append(z.permute(0, 3, 1, 2).to(torch.float16))
        captions.append(clip_caption(clip))
        if (index - first + 1) % 2000 == 0:
            print(f"data: {index - first + 1}/{count} clips from clip {first} ({time.time() - start:.0f} s)", flush=True)
    return {"latents": torch.stack(latents), "captions": captions}


def build_reflow_data(target: BlockCausalVideoTransformer, words: torch.Tensor, timesteps: list[float],
                      guidance_scale: float, seed: int, batch: int = 64) -> dict:
    """The target's videos for the prompts ``words [N, L]`` (``timesteps``, ``guidance_scale``, Euler) with the
    noise every block started from: ``{"latents", "noise"}`` fp16 ``[N, F, C, h, w]``, ``"words"``. Deterministic
    for a seed (one generator, prompts in order, ``batch`` videos per call)."""
    generator = torch.Generator().manual_seed(seed)
    latents, noise = [], []
    start = time.time()
    for first in range(0, words.shape[0], batch):
        video, start_noise = sample_with_noise(target, words[first:first + batch], None, timesteps, generator,
                                               guidance_scale)
        latents.append(video.to(torch.float16))
        noise.append(start_noise.to(torch.float16))
        print(f"reflow data: {first + video.shape[0]}/{words.shape[0]} target videos ({time.time() - start:.0f} s)",
              flush=True)
    return {"latents": torch.cat(latents), "noise": torch.cat(noise), "words": words.clone()}


def init_from(model: BlockCausalVideoTransformer, folder: Path, layers: list[int] | None = None) -> None:
    """Copy a trained model's weights into ``model``: the start of a second stage (same architecture) or, with
    ``layers``, of a drafter made of some of a deeper model's blocks (``layers[i]`` of the trained model
    becomes block ``i``; embeddings, time MLP and output head are copied whole: a layer-skip start that
    shares the target's input and output spaces)."""
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--init: no trained model at {folder}")
    trained = BlockCausalVideoTransformer.from_pretrained(folder)
    ignore = {"condition_dropout"} | ({"num_layers"} if layers is not None else set())  # a training knob
    mismatched = {k: (v, model.config[k]) for k, v in trained.config.items()
                  if not k.startswith("_") and k in model.config and k not in ignore and model.config[k] != v}
    if mismatched:
        raise ValueError(f"--init: {folder} has another architecture (value there, here): {mismatched}")
    state = trained.state_dict()
    if layers is not None:
        depth = trained.config.num_layers
        if len(layers) != model.config.num_layers or any(not 0 <= i < depth for i in layers):
            raise ValueError(f"--init-layers: need {model.config.num_layers} block indices in [0, {depth}), "
                             f"got {layers}")
        new_index = {str(old): str(new) for new, old in enumerate(layers)}
        state = {_renumber_block(k, new_index): v for k, v in state.items()
                 if not k.startswith("blocks.") or k.split(".")[1] in new_index}
    model.load_state_dict({k: v.float() for k, v in state.items()})


def _renumber_block(key: str, new_index: dict[str, str]) -> str:
    """``blocks.<old>.rest`` -> ``blocks.<new>.rest``; other keys unchanged."""
    parts = key.split(".")
    if parts[0] == "blocks":
        parts[1] = new_index[parts[1]]
    return ".".join(parts)


def _timesteps_option(parser: argparse.ArgumentParser, option: str, text: str, sort: bool = False) -> list[float]:
    """A comma-separated timestep option as checked timesteps (``sort``: distinct values, decreasing);
    anything else is the parser's usage error."""
    try:
        values = [float(t) for t in text.split(",")]
        return check_timesteps(sorted(set(values), reverse=True) if sort else values)
    except ValueError as error:
        parser.error(f"{option}: {error}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the trained model (save_pretrained)")
    parser.add_argument("--role", choices=sorted(ROLES), default="target", help="size preset")
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--mlp-ratio", type=float, default=4.0)
    parser.add_argument("--num-frames", type=int, default=16)
    parser.add_argument("--frames-per-block", type=int, default=2)
    parser.add_argument("--text-length", type=int, default=24)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--condition-dropout", type=float, default=0.1)
    parser.add_argument("--no-rope", action="store_true", help="learned absolute positions only")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--train-clips", type=int, default=10000)
    parser.add_argument("--difficulty", type=float, default=DIFFICULTY)
    parser.add_argument("--tokenizer", type=Path, default=zoo_tokenizer_path("continuous"))
    parser.add_argument("--data", type=Path, default=None, help="reuse this data.pt (same data arguments)")
    parser.add_argument("--init", type=Path, default=None, help="start from this trained model (second stage)")
    parser.add_argument("--init-layers", default=None,
                        help="with --init: comma-separated block indices of the (deeper) --init model that become "
                             "this model's blocks, e.g. a drafter from the target's blocks 0,7")
    parser.add_argument("--first-block-batch", type=int, default=0,
                        help="extra first blocks (no context) per step, from --first-block-clips fresh clips")
    parser.add_argument("--first-block-clips", type=int, default=50000)
    parser.add_argument("--self-context", type=float, default=0.0,
                        help="share of clips whose context is the model's own one-shot prediction of it (from a "
                             "--context-timesteps timestep) instead of the ground truth: teaches it to continue "
                             "from its own imperfect blocks (exposure bias); one extra forward per step")
    parser.add_argument("--rollout-context", type=float, default=0.0,
                        help="share of (other) clips whose context is the model's own rollout from the real first "
                             "block (compounding errors as at inference; 4 sampling passes per block, no gradients)")
    parser.add_argument("--rollout-guidance", type=float, default=3.0,
                        help="classifier-free guidance of those rollouts (the pipeline's benchmarks use 3)")
    parser.add_argument("--context-timesteps", default="250,500,750",
                        help="comma-separated timesteps the predicted context is made from (larger: blurrier)")
    parser.add_argument("--reflow-from", type=Path, default=None, metavar="TARGET",
                        help="train on this target model's own videos and their start noise (reflow distillation: "
                             "a few-step drafter) instead of the data clips; needs --train-clips >= --reflow-clips")
    parser.add_argument("--reflow-clips", type=int, default=4000, help="target videos to sample for --reflow-from")
    parser.add_argument("--reflow-data", type=Path, default=None,
                        help="with --reflow-from: reuse this reflow.pt (an earlier run's target videos) instead of "
                             "sampling them")
    parser.add_argument("--reflow-guidance", type=float, default=3.0,
                        help="classifier-free guidance of the target's videos (the benchmarks' 3)")
    parser.add_argument("--reflow-timesteps", default="1000",
                        help="comma-separated timesteps the drafter will sample with (its training timesteps)")
    parser.add_argument("--fixed-fraction", type=float, default=0.5,
                        help="share of blocks trained at the sampling (or --reflow-) timesteps; the rest uniform")
    parser.add_argument("--work", type=Path, default=None, help="default: runs/train_video_<role>")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    add_data_workers_argument(parser)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if args.init_layers is not None and args.init is None:
        parser.error("--init-layers needs --init")
    if args.first_block_batch < 0 or args.first_block_clips < 1:
        parser.error("--first-block-batch must be >= 0 and --first-block-clips >= 1")
    try:
        check_context_shares(args.self_context, args.rollout_context)
    except ValueError as error:
        parser.error(f"--self-context / --rollout-context: {error}")
    context_timesteps = _timesteps_option(parser, "--context-timesteps", args.context_timesteps, sort=True)
    if not 0.0 <= args.fixed_fraction <= 1.0:
        parser.error(f"--fixed-fraction must be in [0, 1], got {args.fixed_fraction}")
    sampling_timesteps = DEFAULT_TIMESTEPS
    if args.reflow_from is not None:
        if not 0 < args.reflow_clips <= args.train_clips:
            parser.error(f"--reflow-clips must be in [1, --train-clips={args.train_clips}], got {args.reflow_clips}")
        sampling_timesteps = _timesteps_option(parser, "--reflow-timesteps", args.reflow_timesteps)
    preset = ROLES[args.role]
    dim, layers, heads = (args.dim or preset["dim"], args.layers or preset["layers"], args.heads or preset["heads"])
    args.work = args.work or Path(f"runs/train_video_{args.role}")
    start_run(args)

    tokenizer = ContinuousTokenizer.from_pretrained(str(args.tokenizer)).eval()
    words = WordTokenizer(vocabulary())
    build = lambda: build_data(args.train_clips, args.seed, tokenizer, words, args.text_length,  # noqa: E731
                               args.num_frames, args.difficulty, workers=args.data_workers)
    if args.data is not None:
        if not args.data.is_file():
            raise FileNotFoundError(f"--data: no such file {args.data}")
        data = torch.load(args.data)
    else:
        data = cached_data(args.work, build, key=args_key(args, "train_clips", "seed", "text_length", "num_frames",
                                                          "difficulty", "tokenizer"))
    num_clips = data["latents"].shape[0]
    if tuple(data["latents"].shape[1:3]) != (args.num_frames, tokenizer.config.latent_dim):
        raise ValueError(f"cached data has latents {tuple(data['latents'].shape)}; delete {args.work}/data.pt or "
                         f"pass matching --num-frames")

    c, h, w = data["latents"].shape[2:]
    model = BlockCausalVideoTransformer(latent_channels=c, latent_size=h, patch_size=2, num_frames=args.num_frames,
                                        frames_per_block=args.frames_per_block, dim=dim, num_layers=layers,
                                        num_heads=heads, mlp_ratio=args.mlp_ratio, text_vocab_size=len(words),
                                        text_length=args.text_length, condition_dropout=args.condition_dropout,
                                        rope=not args.no_rope)
    print(f"{args.role}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {num_clips} clips",
          flush=True)
    if args.init is not None and not (args.work / "checkpoint.pt").is_file():
        layers = None if args.init_layers is None else [int(i) for i in args.init_layers.split(",")]
        init_from(model, args.init, layers)  # a resumed run restores its own checkpoint instead
    first = None
    if args.first_block_batch > 0:
        first = cached_data(args.work, lambda: build_data(  # fresh clips (far past the training clips' indices)
            args.first_block_clips, args.seed, tokenizer, words, args.text_length, args.num_frames,
            args.difficulty, first_index=FIRST_BLOCK_INDEX, render_frames=args.frames_per_block,
            workers=args.data_workers),
            name="first_blocks.pt", key=args_key(args, "first_block_clips", "seed", "text_length", "num_frames",
                                                 "difficulty", "frames_per_block", "tokenizer"))
    if args.reflow_from is not None:
        if not (args.reflow_from / "config.json").is_file():
            raise FileNotFoundError(f"--reflow-from: no trained model at {args.reflow_from}")
        target = BlockCausalVideoTransformer.from_pretrained(args.reflow_from).float().eval()
        if (target.config.num_frames, target.config.frames_per_block) != (args.num_frames, args.frames_per_block):
            raise ValueError(f"--reflow-from: {args.reflow_from} makes {target.config.num_frames} frames in blocks "
                             f"of {target.config.frames_per_block}, this run {args.num_frames} in {args.frames_per_block}")
        if args.reflow_data is not None:
            if not args.reflow_data.is_file():
                raise FileNotFoundError(f"--reflow-data: no such file {args.reflow_data}")
            data = torch.load(args.reflow_data)
            if "noise" not in data:
                raise ValueError(f"--reflow-data: {args.reflow_data} holds no start noise (not a reflow.pt)")
        else:
            data = cached_data(args.work, lambda: build_reflow_data(
                target, data["words"][:args.reflow_clips], list(DEFAULT_TIMESTEPS), args.reflow_guidance, args.seed),
                name="reflow.pt", key=args_key(args, "reflow_from", "reflow_clips", "reflow_guidance", "seed",
                                               "train_clips", "text_length", "num_frames", "difficulty", "tokenizer"))
        num_clips = data["latents"].shape[0]
        del target
    out = Path(args.out)

    def save(trained: BlockCausalVideoTransformer) -> None:
        save_fp16_copy(trained, out)
        words.save(out / TEXT_VOCAB_FILE)

    device = torch.device(args.device)

    def batch_loss(clips: dict, index: torch.Tensor) -> torch.Tensor:
        ids = clips["words"][index].clone()
        ids[torch.rand(ids.shape[0]) < args.condition_dropout] = -1  # all padding -> the model's null prompt
        noise = clips["noise"][index].to(device).float() if "noise" in clips else None
        return flow_matching_loss(model, clips["latents"][index].to(device).float(), ids.to(device),
                                  fixed_timesteps=sampling_timesteps, fixed_fraction=args.fixed_fraction,
                                  self_context=args.self_context, context_timesteps=context_timesteps,
                                  rollout=args.rollout_context, rollout_guidance=args.rollout_guidance, noise=noise)

    def loss_fn(index: torch.Tensor) -> torch.Tensor:
        loss = batch_loss(data, index)
        if first is not None:
            loss = loss + batch_loss(first, torch.randint(0, first["latents"].shape[0], (args.first_block_batch,)))
        return loss

    np.random.seed(args.seed)
    train_loop(model, loss_fn, num_clips, steps=args.steps, batch=args.batch, lr=args.lr, work=args.work, save=save,
               save_every=args.save_every, stop_at=args.stop_at, device=device,
               time_limit=time_left(args))


if __name__ == "__main__":
    main()
