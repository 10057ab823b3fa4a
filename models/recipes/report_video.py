"""Assemble and report the ``mmspec/shapes-video`` zoo entry.

``build``: the trained target and drafter (``train_video``) plus the zoo's continuous tokenizer become an
:class:`~mmspec.pipelines.ar_video.ARVideoPipeline` folder written by ``save_pretrained`` (models in fp16 on
disk; loading computes in fp32), so ``ARVideoPipeline.from_pretrained("mmspec/shapes-video")`` works offline.

``build`` also writes the methods' recommended settings (``speculation_config.json``,
:data:`SPECULATION_SETTINGS`), so ``pipe(..., method="sdvg")`` runs with the settings the benchmark measured
best; ``settings`` writes only that file into an assembled folder.

``report``: the exact evaluator's scores of target-only and draft-only generation on the video prompt
set (one video per prompt, seed i for prompt i): mean per-frame score, clip accuracy (identity and
motion) and each prompt's mean per-frame score (so a test can re-measure a few), written to
``<folder>/report.json``.

    python -m mmspec.models.recipes.report_video build --target runs/train_video_target/model \\
        --drafter runs/train_video_drafter/model --folder models/zoo/shapes-video
    python -m mmspec.models.recipes.report_video settings --folder models/zoo/shapes-video  # the table alone
    python -m mmspec.models.recipes.report_video report --folder models/zoo/shapes-video --prompts 100
    python -m mmspec.models.recipes.report_video block-loss --model models/zoo/shapes-video/transformer

``block-loss``: the teacher-forced loss of each block at one timestep on held-out clips, with the right
prompt and with the null prompt (the diagnosis behind the target's second training stage).

``context``: how much of each model's error is its own context (exposure bias). For every prompt a world
clip of that prompt is rendered, and each model's per-frame score after the first block is measured three
ways: on its own rollout from the prompt; continuing the clip's real first block (``context_frames``);
and with the real clip as the context of every block (block n generated after the clip's first n blocks,
teacher forcing at inference). SDVG continuing the real first block is measured too (acceptance, score):

    python -m mmspec.models.recipes.report_video context --folder models/zoo/shapes-video --prompts 40
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmspec.files import write_json_atomic
from mmspec.models.recipes.common import save_zoo_folder
from mmspec.models.recipes.train_video import DIFFICULTY, TEXT_VOCAB_FILE, build_data
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import ContinuousTokenizer, zoo_tokenizer_path
from mmspec.models.video import BlockCausalVideoTransformer
from mmspec.world import clip_for_prompt, evaluate_videos, make_video_prompt_set, render_video, vocabulary

#: The command of the benchmark that measured :data:`SPECULATION_SETTINGS` (docs/benchmarks/video_cpu.md: a tau
#: sweep of SDVG against target-only and draft-only decoding, guidance 3, the drafter in one unguided step).
MEASURED_BY = ("python -m mmspec.evaluation.bench_video --threads 1 --speed-prompts 48 --repeats 5 "
               "--out docs/benchmarks/video_cpu.md")

#: The drafter's sampling: the reflow-distilled drafter drafts in one unguided step (its guidance is distilled in).
_REFLOW_DRAFTER = {"draft_num_inference_steps": 1, "draft_guidance_scale": 1.0}

#: The zoo's recommended settings per method (``speculation_config.json``): the fastest SDVG case of the sweep
#: that met both goals of the benchmark (>= 1.5x faster than the target alone, >= 98 % of its per-frame score,
#: above draft-only; ``MEASURED_BY``): the ``match`` reward (each found object weighted by its template match),
#: the worst frame against tau 0.1, the first block forced to the target, and a rejected draft refined by the
#: target from t=750 (3 of its 4 passes) instead of redrawn from noise: 1.53x at 101.1 % of the target's
#: per-frame score. Cases that were faster (refined from 500, 1.76x; the block mean against 0.3, refined from 750,
#: 1.59x) lost quality (93-94 %) and are not defaults. ``refine_rejected_from=750`` is one of the target's
#: timesteps for 4 denoising steps (and 8, 12, ...); other step counts must set it in the config.
SPECULATION_SETTINGS: dict[str, dict] = {
    "sdvg": {"settings": {**_REFLOW_DRAFTER, "tau": 0.1, "reward": "shapes", "reward_kwargs": {"mode": "match"},
                          "aggregate": "min", "force_reject_first": True, "refine_rejected_from": 750.0}},
    "draft": {"settings": dict(_REFLOW_DRAFTER)},
}


def build(target: Path, drafter: Path, folder: Path, tokenizer: Path, draft_steps: int | None = None,
          draft_guidance_scale: float | None = None) -> None:
    """Write the pipeline folder with :data:`SPECULATION_SETTINGS`; ``draft_steps`` / ``draft_guidance_scale``
    become the pipeline's drafter sampling defaults (a reflow drafter: 1 step, guidance 1)."""
    from mmspec.pipelines.ar_video import ARVideoPipeline  # recipes may assemble pipelines (lazy import)

    for name, path in (("--target", target), ("--drafter", drafter)):
        if not (path / "config.json").is_file():
            raise SystemExit(f"{name}: no trained model at {path}; run models.recipes.train_video first")
    half = torch.float16  # the recipe saves fp16 weights; keep them so the zoo stays small
    pipe = ARVideoPipeline(
        transformer=BlockCausalVideoTransformer.from_pretrained(target, torch_dtype=half),
        vae=ContinuousTokenizer.from_pretrained(str(tokenizer)),
        drafter=BlockCausalVideoTransformer.from_pretrained(drafter, torch_dtype=half),
        text_tokenizer=WordTokenizer.load(target / TEXT_VOCAB_FILE),
        draft_num_inference_steps=draft_steps,
        draft_guidance_scale=draft_guidance_scale,
    )
    pipe.set_speculation_settings(SPECULATION_SETTINGS)
    save_zoo_folder(pipe, folder)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"wrote {folder} ({size / 2**20:.1f} MiB)")


def write_settings(folder: Path) -> Path:
    """Write only ``speculation_config.json`` (:data:`SPECULATION_SETTINGS`) into an assembled folder."""
    from mmspec.pipelines.ar_video import ARVideoPipeline

    pipe = ARVideoPipeline.from_pretrained(folder)
    pipe.set_speculation_settings(SPECULATION_SETTINGS)
    return pipe.speculation_settings.save(folder)


def report(folder: Path, num_prompts: int, threads: int, guidance_scale: float = 3.0,
           draft_guidance_scale: float | None = None, out: Path | None = None, command: str = "") -> dict:
    """Exact-evaluator scores of target-only and draft-only videos (one per prompt, seed i for prompt i),
    written to ``out`` (default ``folder/report.json``)."""
    from mmspec.pipelines.ar_video import ARVideoPipeline

    torch.set_num_threads(threads)
    pipe = ARVideoPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    prompts = make_video_prompt_set(num_prompts)
    draft = pipe.method_config("draft")  # the folder's stored settings, the given guidance over them
    if draft_guidance_scale is not None:
        draft = draft.replace(draft_guidance_scale=draft_guidance_scale)
    draft_steps, draft_guidance = pipe.draft_settings(draft.draft_num_inference_steps, draft.draft_guidance_scale)
    result: dict = {"prompts": num_prompts, "guidance_scale": guidance_scale, "draft_guidance_scale": draft_guidance,
                    "draft_steps": draft_steps, "command": command}
    configs = {"none": "none", "draft": draft}
    for method in ("none", "draft"):
        start = time.perf_counter()
        videos = []
        for i, prompt in enumerate(prompts):
            video = pipe(prompt.text, configs[method], guidance_scale=guidance_scale,
                         generator=torch.Generator().manual_seed(i), output_type="np")
            videos.append((np.clip(video.frames[0], 0, 1) * 255 + 0.5).astype(np.uint8))
        scores = evaluate_videos(videos, prompts)
        name = "target" if method == "none" else "drafter"
        result[name] = {"frame_score": scores.frame_score, "accuracy": scores.accuracy, "identity": scores.identity,
                        "motion": scores.motion, "seconds": round(time.perf_counter() - start, 1),
                        "per_prompt_frame_score": [round(float(np.mean(s.frame_scores)), 6) for s in scores.scores]}
        print(f"{name}: {({k: v for k, v in result[name].items() if k != 'per_prompt_frame_score'})}", flush=True)
    write_json_atomic((out or folder / "report.json"), result, indent=1)
    return result


@torch.no_grad()
def block_losses(model: BlockCausalVideoTransformer, latents: torch.Tensor, words: torch.Tensor,
                 timestep: float, seed: int = 0) -> dict[str, list[float]]:
    """Teacher-forced flow-matching loss of every block at one ``timestep`` (0-1000), with the clips' own
    prompts and with the null prompt: how much each block still has to learn and how much of it the
    prompt explains (later blocks can copy their objects from the clean context; the first cannot)."""
    clean = latents.float()
    blocks = clean.shape[1] // model.config.frames_per_block
    eps = torch.randn(clean.shape, generator=torch.Generator().manual_seed(seed))
    t = timestep / 1000.0
    noisy = (1 - t) * clean + t * eps
    times = torch.full((clean.shape[0], blocks), float(timestep))
    out = {}
    for name, ids in (("prompt", words), ("null prompt", torch.full_like(words, -1))):
        err = (model.forward_train(clean, noisy, times, ids).float() - (eps - clean)) ** 2
        per_block = err.mean(dim=(2, 3, 4)).view(clean.shape[0], blocks, -1).mean(dim=(0, 2))
        out[name] = [round(v, 4) for v in per_block.tolist()]
    return out


def block_loss_report(folder: Path, num_clips: int, timestep: float, tokenizer: Path) -> dict[str, list[float]]:
    """:func:`block_losses` of a saved model on ``num_clips`` held-out clips (test stream, seed 0)."""
    torch.set_num_threads(1)
    model = BlockCausalVideoTransformer.from_pretrained(folder).float().eval()
    vocab_file = folder / TEXT_VOCAB_FILE  # a pipeline folder's drafter has none: train_video's vocabulary
    words = WordTokenizer.load(vocab_file) if vocab_file.is_file() else WordTokenizer(vocabulary())
    data = build_data(num_clips, 0, ContinuousTokenizer.from_pretrained(str(tokenizer)).eval(), words,
                      model.config.text_length, model.config.num_frames, DIFFICULTY, split="test")
    return block_losses(model, data["latents"], data["words"], timestep)


def context_report(folder: Path, num_prompts: int, threads: int, guidance_scale: float = 3.0, tau: float = 0.1,
                   out: Path | None = None, command: str = "") -> dict:
    """Per-frame scores after the first block of each model on its own rollout, continuing a real first
    block, and with the real clip as every block's context; plus SDVG (``match`` reward, worst frame,
    ``tau``) continuing the real first block. Written to ``out`` (default ``folder/context_report.json``)."""
    from mmspec.pipelines.ar_video import ARVideoPipeline

    torch.set_num_threads(threads)
    pipe = ARVideoPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    fb, blocks = pipe.frames_per_block, pipe.max_blocks
    num_frames = fb * blocks
    scores: dict[str, list[float]] = {}
    accepted: list[float] = []

    def add(name: str, frames: np.ndarray, prompt) -> None:  # frames [F, H, W, 3] in [0, 1]
        video = (np.clip(frames, 0, 1) * 255 + 0.5).astype(np.uint8)
        frame_scores = evaluate_videos([video], [prompt]).scores[0].frame_scores[fb:]
        scores.setdefault(name, []).append(float(np.mean(frame_scores)))

    def generate(prompt, seed: int, method: Any, **kwargs) -> Any:
        return pipe(prompt.text, method, guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(seed),
                    output_type="np", **kwargs)

    for i, prompt in enumerate(make_video_prompt_set(num_prompts)):
        clip = render_video(clip_for_prompt(prompt, rng=i, num_frames=num_frames),
                            image_size=getattr(pipe.vae.config, "image_size", 32), difficulty=DIFFICULTY)
        real = torch.from_numpy(clip).permute(0, 3, 1, 2).float()[None] / 255  # [1, F, 3, H, W]
        call = partial(generate, prompt, i)
        for role, method in (("target", "none"), ("drafter", "draft")):
            add(f"{role}: own rollout", call(method).frames[0], prompt)
            add(f"{role}: real first block", call(method, context_frames=real[:, :fb]).frames[0], prompt)
            teacher = [call(method, context_frames=real[:, :fb * n], num_blocks=n + 1).frames[0][fb * n:]
                       for n in range(1, blocks)]
            add(f"{role}: real context", np.concatenate([real[0, :fb].permute(0, 2, 3, 1).numpy(), *teacher]), prompt)
        spec = call(pipe.method_config("sdvg").replace(tau=tau, reward="shapes", reward_kwargs={"mode": "match"},
                                                       aggregate="min", refine_rejected_from=None),
                    context_frames=real[:, :fb])
        add("sdvg: real first block", spec.frames[0], prompt)
        accepted.append(spec.stats.acceptance_rate)
    result = {"prompts": num_prompts, "guidance_scale": guidance_scale, "tau": tau, "command": command,
              "frame_score_after_first_block": {k: round(float(np.mean(v)), 4) for k, v in scores.items()},
              "sdvg_acceptance_real_first_block": round(float(np.nanmean(accepted)), 4)}
    for name, value in result["frame_score_after_first_block"].items():
        print(f"{name}: {value:.3f}")
    print(f"sdvg (match, tau {tau}) continuing the real first block: acceptance {np.nanmean(accepted):.3f}")
    write_json_atomic((out or folder / "context_report.json"), result, indent=1)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the pipeline folder")
    b.add_argument("--target", type=Path, default=Path("runs/train_video_target/model"))
    b.add_argument("--drafter", type=Path, default=Path("runs/train_video_drafter/model"))
    b.add_argument("--folder", type=Path, default=Path("models/zoo/shapes-video"))
    b.add_argument("--tokenizer", type=Path, default=zoo_tokenizer_path("continuous"))
    b.add_argument("--draft-steps", type=int, default=None,
                   help="the drafter's default denoising steps per block (a reflow drafter: 1)")
    b.add_argument("--draft-guidance-scale", type=float, default=None,
                   help="the drafter's default guidance (a reflow drafter: 1, its guidance is distilled in)")
    st = sub.add_parser("settings", help="write only speculation_config.json (SPECULATION_SETTINGS)")
    st.add_argument("--folder", type=Path, default=Path("models/zoo/shapes-video"))
    r = sub.add_parser("report", help="evaluator scores of the target and the drafter")
    r.add_argument("--folder", type=Path, default=Path("models/zoo/shapes-video"))
    r.add_argument("--prompts", type=int, default=100)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--guidance-scale", type=float, default=3.0, help="classifier-free guidance of both models")
    r.add_argument("--draft-guidance-scale", type=float, default=None, help="the drafter's (default: the same)")
    r.add_argument("--out", type=Path, default=None, help="result file (default: FOLDER/report.json)")
    bl = sub.add_parser("block-loss", help="per-block loss with and without the prompt on held-out clips")
    bl.add_argument("--model", type=Path, required=True)
    bl.add_argument("--clips", type=int, default=48, help="held-out clips (test stream)")
    bl.add_argument("--timestep", type=float, default=750.0)
    bl.add_argument("--tokenizer", type=Path, default=zoo_tokenizer_path("continuous"))
    cx = sub.add_parser("context", help="scores on own rollouts vs the real first block vs real context")
    cx.add_argument("--folder", type=Path, default=Path("models/zoo/shapes-video"))
    cx.add_argument("--prompts", type=int, default=40)
    cx.add_argument("--threads", type=int, default=1)
    cx.add_argument("--guidance-scale", type=float, default=3.0)
    cx.add_argument("--tau", type=float, default=0.1, help="SDVG's threshold on the match reward")
    cx.add_argument("--out", type=Path, default=None, help="result file (default: FOLDER/context_report.json)")
    args = parser.parse_args(argv)
    command = "python -m mmspec.models.recipes.report_video " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.command == "context":
        context_report(args.folder, args.prompts, args.threads, args.guidance_scale, args.tau, args.out, command)
    elif args.command == "block-loss":
        print(json.dumps(block_loss_report(args.model, args.clips, args.timestep, args.tokenizer)))
    elif args.command == "settings":
        print(f"wrote {write_settings(args.folder)}")
    elif args.command == "build":
        build(args.target, args.drafter, args.folder, args.tokenizer, args.draft_steps, args.draft_guidance_scale)
    else:
        report(args.folder, args.prompts, args.threads, args.guidance_scale, args.draft_guidance_scale, args.out,
               command)


if __name__ == "__main__":
    main()
