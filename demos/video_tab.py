"""The AR video tab: block-causal video generation (:class:`~mmspec.pipelines.ar_video.ARVideoPipeline`),
SDVG (reward-routed draft blocks) next to the target-only baseline, with the per-block accept/reject
strip and each block's reward. Each run's videos are shown twice: animated (a looping GIF, every video of
the run in one picture) and as a film strip (every frame at once). SDVG runs with the checkpoint's stored
settings (``pipe.method_config("sdvg")``, what a call with ``method="sdvg"`` runs) with the page's knobs over
them; an empty knob keeps the stored value."""

from __future__ import annotations

import atexit
import html
import math
import os
import shutil
import tempfile
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch

from mmspec.demos.common import (
    CPU_NOTE,
    DRAFT_COLOR,
    REJECT_COLOR,
    TARGET_COLOR,
    Comparison,
    DemoError,
    PipelineCache,
    Report,
    check_choice,
    check_float,
    check_int,
    check_request,
    headline_html,
    label_band,
    legend_html,
    panel,
    stats_html,
    to_pil_list,
    warm_up_and_compare,
)
from mmspec.demos.timing import DEFAULT_REPEATS, MAX_REPEATS

METHODS = ("sdvg", "draft")
REWARDS = ("shapes", "imagereward", "clip")  # "shapes" needs no weights; the others read local files
#: files of an ImageReward folder given in the reward-weights field (nothing is downloaded)
IMAGEREWARD_FILES = {"weights": "ImageReward.pt", "med_config": "med_config.json", "tokenizer": "tokenizer"}
AGGREGATES = ("min", "mean")
#: the page's choice (reward, aggregate, first-block rule) that keeps the checkpoint's setting
STORED = "checkpoint"
#: the first-block rule's page choices besides :data:`STORED`
FIRST_BLOCK = {"yes": True, "no": False}
DEFAULT_PATH = "mmspec/shapes-video"
EXAMPLE_PROMPTS = ("a red circle moving right", "a blue square moving up and a green diamond moving down",
                   "a yellow triangle moving left")

INPUTS = ("path", "prompt", "method", "num_videos", "seed", "tau", "reward", "reward_weights", "aggregate",
          "force_reject_first", "refine_rejected_from", "num_blocks", "num_inference_steps", "guidance_scale",
          "repeats")

STRIP_LEGEND = ((DRAFT_COLOR, "drafted block, accepted"), (REJECT_COLOR, "drafted block rejected: target's block"),
                (TARGET_COLOR, "target's block (not drafted)"))


#: frames per second of the animations (a block of the zoo's 2 frames lasts half a second)
ANIMATION_FPS = 4
#: side of a frame in the animations (pixels; nearest-neighbour upscaling, like the film strips)
ANIMATION_SIZE = 192
#: side of a frame in the film strips (pixels): 8 frames fill the page's width
STRIP_SIZE = 128


@dataclass
class VideoResult:
    """Animations (the path of a looping GIF per run, every video in it: :func:`animation_frames`), film
    strips (one image per run, a row per video under its prompt), the block strip, the result card, the
    statistics."""

    spec_animation: str
    spec_strip: PIL.Image.Image
    base_animation: str
    base_strip: PIL.Image.Image
    blocks_html: str
    card_html: str
    stats_html: str
    comparison: Comparison


def block_decisions(stats: Any) -> list[list[dict[str, Any]]]:
    """Per video and block: who made the block, whether it was drafted and routed, and its reward.

    Each entry: ``{"block", "source" ("draft"/"target"), "decision" (text), "kind" ("accepted",
    "rejected", "target", "draft"), "reward" (float or None)}``.
    """
    accepted, routed = stats.accepted, stats.routed
    scores = stats.block_scores
    videos = []
    for b in range(accepted.shape[0]):
        row = []
        for n in range(accepted.shape[1]):
            is_draft, was_routed = bool(accepted[b, n]), bool(routed[b, n]) if routed is not None else False
            score = None if scores is None or math.isnan(float(scores[b, n])) else float(scores[b, n])
            if was_routed:
                kind = "accepted" if is_draft else "rejected"
                text = "draft accepted" if is_draft else "draft rejected -> target"
            elif is_draft:
                kind, text = "draft", "draft (drafter-only run)"
            else:
                kind, text = "target", "target"
            row.append({"block": n, "source": "draft" if is_draft else "target", "decision": text, "kind": kind,
                        "reward": score})
        videos.append(row)
    return videos


KIND_COLORS = {"accepted": DRAFT_COLOR, "draft": DRAFT_COLOR, "rejected": REJECT_COLOR, "target": TARGET_COLOR}


def block_strip_html(stats: Any, tau: float, prompts: list[str], method: str = "sdvg") -> str:
    """One row of blocks per video: decision and reward of each block, coloured like the film strip, under
    a line saying how ``method`` chose the blocks (SDVG's routing with ``tau``, or the drafter alone)."""
    rows = []
    for b, blocks in enumerate(block_decisions(stats)):
        cells = []
        for block in blocks:
            reward = "-" if block["reward"] is None else f"{block['reward']:.3f}"
            color = KIND_COLORS[block["kind"]]
            cells.append(f"<td class='mmspec-block mmspec-block-{block['kind']}' style='background:rgba{(*color, 0.35)}'>"
                         f"<b>block {block['block']}</b><br>{html.escape(block['decision'])}<br>reward {reward}</td>")
        label = html.escape(prompts[b] if b < len(prompts) else f"video {b}")
        rows.append(f"<tr><th>video {b}: {label}</th>{''.join(cells)}</tr>")
    if method == "sdvg":
        rule = f"SDVG routing, tau = {tau:g} (a drafted block is accepted when its reward >= tau)"
    else:
        rule = "drafter only: every block comes from the drafter, nothing is scored or routed"
    return (f"<div class='mmspec-blocks'><p>{html.escape(rule)}</p><table>{''.join(rows)}</table>"
            f"{legend_html(STRIP_LEGEND)}</div>")


GAP, BAR = 6, 8  # pixels: white gap between blocks / videos, height of the "who made it" bar


def frame_tile(frame: PIL.Image.Image, color: tuple[int, int, int], size: int) -> np.ndarray:
    """One frame upscaled to ``size`` x ``size`` (nearest neighbour) over a :data:`BAR`-pixel bar of
    ``color`` (who made its block): uint8 ``[size + BAR, size, 3]``. Film strips and animations share it."""
    tile = np.asarray(frame.convert("RGB").resize((size, size), PIL.Image.NEAREST))
    return np.concatenate([tile, np.broadcast_to(np.asarray(color, np.uint8), (BAR, size, 3))], 0)


def _block_color(kinds: list[list[str]] | None, video: int, frame: int, frames_per_block: int) -> tuple[int, int, int]:
    """The colour of the block holding ``frame`` of ``video`` (all target-coloured when ``kinds`` is None)."""
    return KIND_COLORS[kinds[video][frame // frames_per_block]] if kinds is not None else TARGET_COLOR


def _stack(parts: list[np.ndarray], axis: int) -> np.ndarray:
    """``parts`` concatenated along ``axis`` (0: rows, 1: columns) with a white :data:`GAP` between them."""
    spaced = []
    for part in parts:
        if spaced:
            shape = list(part.shape)
            shape[axis] = GAP
            spaced.append(np.full(shape, 255, np.uint8))
        spaced.append(part)
    return np.concatenate(spaced, axis)


def film_strip(videos: list[list[PIL.Image.Image]], kinds: list[list[str]] | None, frames_per_block: int,
               size: int = STRIP_SIZE, labels: list[str] | None = None) -> PIL.Image.Image:
    """The frames of every video in a row (one row per video, ``labels[v]`` written above it), blocks
    separated by a gap, each block underlined in its colour (:data:`KIND_COLORS`; all target-coloured when
    ``kinds`` is None)."""
    rows = []
    for v, frames in enumerate(videos):
        blocks = [np.concatenate([frame_tile(frames[f], _block_color(kinds, v, f, frames_per_block), size)
                                  for f in range(start, min(start + frames_per_block, len(frames)))], 1)
                  for start in range(0, len(frames), frames_per_block)]
        row = _stack(blocks, 1)
        if labels is not None:
            row = np.concatenate([np.asarray(label_band(labels[v], row.shape[1])), row], 0)
        rows.append(row)
    return PIL.Image.fromarray(_stack(rows, 0))


def animation_frames(videos: list[list[PIL.Image.Image]], kinds: list[list[str]] | None, frames_per_block: int,
                     per_row: int, size: int = ANIMATION_SIZE) -> list[PIL.Image.Image]:
    """The frames of an animation showing every video at once: frame ``f`` tiles frame ``f`` of each video,
    ``per_row`` videos side by side (one row per prompt with ``per_row`` = videos per prompt), each over the
    bar of the block it is in (coloured as in :func:`film_strip`), and a playhead under the grid (dark up to
    frame ``f``, its ticks separating blocks), so no two frames are identical (a GIF writer would merge
    those) and the viewer sees where in the video the loop is."""
    num_frames = len(videos[0])
    if any(len(frames) != num_frames for frames in videos):
        raise ValueError(f"every video needs the same number of frames, got {[len(v) for v in videos]}")
    grids = []
    for f in range(num_frames):
        tiles = [PIL.Image.fromarray(frame_tile(frames[f], _block_color(kinds, v, f, frames_per_block), size))
                 for v, frames in enumerate(videos)]
        grids.append(np.asarray(panel([tiles[i:i + per_row] for i in range(0, len(tiles), per_row)], gap=GAP)))
    width = grids[0].shape[1]
    bounds = [round(width * k / num_frames) for k in range(num_frames + 1)]  # the playhead's segment per frame
    ticks = range(frames_per_block, num_frames, frames_per_block) if width >= 4 * num_frames else ()
    images = []
    for f, grid in enumerate(grids):
        playhead = np.full((BAR, width, 3), 228, np.uint8)  # light grey
        playhead[:, :bounds[f + 1]] = (63, 63, 70)  # dark grey up to and including this frame
        for start in ticks:  # white ticks where blocks start (segments of >= 4 pixels keep frames distinct)
            playhead[:, bounds[start] - 1:bounds[start] + 1] = 255
        images.append(PIL.Image.fromarray(_stack([grid, playhead], 0)))
    return images


class AnimationFolder:
    """Where the tab writes its GIFs: one temp folder per process (made on first use, removed at exit), of
    which only the ``keep`` newest files are kept, so it does not grow with the number of runs. The page
    copies each result into gradio's cache as soon as the run returns, so older files are not needed."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._folder: Path | None = None
        self._files: deque[Path] = deque()
        self._lock = threading.Lock()

    @property
    def folder(self) -> Path:
        """The folder (made, or made again if something removed it)."""
        if self._folder is None or not self._folder.is_dir():
            self._folder = Path(tempfile.mkdtemp(prefix="mmspec-demo-video-"))
            atexit.register(shutil.rmtree, self._folder, ignore_errors=True)
        return self._folder

    def write(self, frames: list[PIL.Image.Image], name: str, fps: int = ANIMATION_FPS) -> str:
        """``frames`` as a GIF looping forever at ``fps`` (the pipeline's :func:`export_video`), under a fresh
        name starting with ``name``; the oldest files beyond :attr:`keep` are deleted. Returns the path."""
        from mmspec.pipelines.ar_video import export_video

        with self._lock:
            handle, path = tempfile.mkstemp(suffix=".gif", prefix=f"{name}-", dir=self.folder)
            os.close(handle)
            self._files.append(Path(path))
            while len(self._files) > self.keep:
                self._files.popleft().unlink(missing_ok=True)
        return str(export_video(frames, path, fps=fps))


ANIMATIONS = AnimationFolder()


def reward_kwargs_for(reward: str, weights: str | None) -> dict[str, Any]:
    """The pipeline's ``reward_kwargs`` from the page's reward-weights field: nothing for "shapes"; for
    "imagereward" a folder with ``ImageReward.pt``, ``med_config.json`` and a ``tokenizer/`` folder
    (bert-base-uncased); for "clip" ``MODEL:FILE`` (an open_clip model name and its local weights)."""
    weights = (weights or "").strip()
    if reward == "shapes":
        if weights:
            raise DemoError("the shapes reward needs no weights: clear the reward-weights field")
        return {}
    if not weights:
        what = ("a folder with ImageReward.pt, med_config.json and tokenizer/" if reward == "imagereward"
                else "MODEL:FILE, an open_clip model name and its local weights file")
        raise DemoError(f"the {reward} reward needs local weights: give {what} in the reward-weights field")
    if reward == "imagereward":
        folder = Path(weights).expanduser()
        missing = [name for name in IMAGEREWARD_FILES.values() if not (folder / name).exists()]
        if missing:
            raise DemoError(f"{folder} lacks {', '.join(missing)} (an ImageReward folder holds ImageReward.pt, "
                            "med_config.json and a bert-base-uncased tokenizer/ folder)")
        return {key: str(folder / name) for key, name in IMAGEREWARD_FILES.items()}
    model, sep, file = (part.strip() for part in weights.partition(":"))
    if not sep or not model or not file:
        raise DemoError(f"the clip reward's weights must read MODEL:FILE (e.g. ViT-B-32:/models/clip.bin), got "
                        f"{weights!r}")
    if not Path(file).expanduser().is_file():
        raise DemoError(f"no CLIP weights file at {file}")
    return {"model": model, "pretrained": str(Path(file).expanduser())}


def _given(value: Any) -> Any:
    """A knob's value, or None when the field is empty or keeps the checkpoint's setting."""
    if value is None or (isinstance(value, str) and (not value.strip() or value == STORED)):
        return None
    return value


def refine_timestep(value: Any, steps: int) -> float | None:
    """The demo's "refine rejected drafts from" field (not empty): 0 -> None (redraw from noise), else one of
    the target's timesteps for ``steps`` denoising steps, below the first (which is pure noise)."""
    timestep = check_float("refine rejected drafts from (timestep)", value, 0.0, 1000.0)
    if timestep == 0:
        return None
    from mmspec.video_blocks import evenly_spaced_timesteps  # the models load lazily, with the page

    choices = evenly_spaced_timesteps(steps, "denoising steps per block")[1:]
    if timestep not in choices:
        raise DemoError(f"refine rejected drafts from must be 0 (redraw from noise) or one of the target's "
                        f"timesteps below 1000 for {steps} steps, {[f'{t:g}' for t in choices]}; got {value!r}")
    return timestep


def sdvg_config(pipe: Any, *, batch_size: int, guidance_scale: float, steps: int, tau: Any = None,
                reward: Any = None, reward_weights: Any = None, aggregate: Any = None, force_reject_first: Any = None,
                refine_rejected_from: Any = None) -> Any:
    """The page's SDVG settings: the checkpoint's stored ones (``pipe.method_config``, what a call with only
    ``method="sdvg"`` runs) with the knobs the page shows replaced, each checked under its label; an empty knob
    (None, "" or :data:`STORED`) keeps the stored value. The reward-weights field configures the chosen (or
    stored) reward; empty, a stored reward keeps its stored settings."""
    config = pipe.method_config("sdvg", batch_size=batch_size, guidance_scale=guidance_scale)
    fields: dict[str, Any] = {}
    if _given(tau) is not None:
        fields["tau"] = check_float("tau (reward threshold)", tau, -1e6, 1e6, allow_inf=True)
    chosen = config.reward if _given(reward) is None else check_choice("reward", reward, REWARDS)
    if not isinstance(chosen, str):
        raise DemoError("the checkpoint's reward is not a named one: choose a reward")
    if _given(reward_weights) is not None or chosen != config.reward:
        fields["reward"], fields["reward_kwargs"] = chosen, reward_kwargs_for(chosen, reward_weights) or None
    if _given(aggregate) is not None:
        fields["aggregate"] = check_choice("aggregate", aggregate, AGGREGATES)
    if _given(force_reject_first) is not None:
        rule = FIRST_BLOCK.get(force_reject_first, force_reject_first) if isinstance(force_reject_first, str) \
            else force_reject_first
        if not isinstance(rule, bool):
            raise DemoError(f"first block always by the target must be {STORED!r}, 'yes' or 'no', got "
                            f"{force_reject_first!r}")
        fields["force_reject_first"] = rule
    if _given(refine_rejected_from) is not None:
        fields["refine_rejected_from"] = refine_timestep(refine_rejected_from, steps)
    return config.replace(**fields) if fields else config


def run_video(cache: PipelineCache, *, path: str = DEFAULT_PATH, prompt: str = EXAMPLE_PROMPTS[0],
              method: str = "sdvg", num_videos: int = 1, seed: int = 0, tau: Any = None, reward: str | None = None,
              reward_weights: str | None = None, aggregate: str | None = None, force_reject_first: Any = None,
              refine_rejected_from: Any = None, num_blocks: int | None = None, num_inference_steps: int = 4,
              guidance_scale: float = 3.0, repeats: int = DEFAULT_REPEATS, report: Report | None = None) -> VideoResult:
    """Generate with SDVG (or drafter only) and target-only with the same seed; return the animations (GIF
    paths in :data:`ANIMATIONS`' folder), the film strips, the per-block decisions with rewards, and the
    statistics. The method runs with the checkpoint's stored settings and the page's knobs over them
    (:func:`sdvg_config`; None or empty: the stored value; "draft" takes none). ``refine_rejected_from``: 0,
    the target redraws a rejected block from noise (SDVG's rule); one of the target's timesteps below 1000, it
    refines the rejected draft from there. Timing: :func:`~mmspec.demos.timing.compare` with ``repeats``
    timed calls per side. SDVG and the drafter are lossy: the card shows the world's per-frame score of both
    sides (:func:`frame_score_quality`); SDVG with tau = +inf is exactly the baseline."""
    method, prompts, videos, seed = check_request(method, METHODS, prompt, num_videos, seed,
                                                  per_prompt_name="videos per prompt", max_per_prompt=4,
                                                  what="videos")
    steps = check_int("denoising steps per block", num_inference_steps, 1, 50)
    guidance = check_float("guidance scale", guidance_scale, 0.0, 20.0)
    pipe = cache.get("video", path)
    batch = len(prompts) * videos
    config = sdvg_config(pipe, batch_size=batch, guidance_scale=guidance, steps=steps, tau=tau, reward=reward,
                         reward_weights=reward_weights, aggregate=aggregate, force_reject_first=force_reject_first,
                         refine_rejected_from=refine_rejected_from) if method == "sdvg" else \
        pipe.method_config(method, batch_size=batch, guidance_scale=guidance)
    blocks = pipe.max_blocks if num_blocks in (None, "", 0) else check_int(
        "blocks", num_blocks, 1, pipe.max_blocks)
    common = dict(num_blocks=blocks, num_inference_steps=steps, guidance_scale=guidance,
                  num_videos_per_prompt=videos)

    def run(name: str, generator: Any, progress: Any, output_type: str = "pil") -> Any:
        return pipe(prompts, "none" if name == "none" else config, generator=generator, output_type=output_type,
                    callback_on_step_end=lambda _p, n, _t, state: progress((n + 1) / blocks) or state, **common)

    comparison = warm_up_and_compare(cache, pipe, "video", run, method, seed, warm_output_type="latent",
                                     repeats=check_int("timed repeats", repeats, 1, MAX_REPEATS), report=report)
    spec, base = comparison.speculative, comparison.baseline
    stats = spec.stats
    rows_prompts = [p for p in prompts for _ in range(videos)]
    routed = int(stats.routed.sum()) if stats.routed is not None else 0
    comparison.extra["blocks from the drafter"] = (f"{int(stats.accepted.sum())} / {stats.accepted.numel()}",
                                                   f"0 / {base.stats.accepted.numel()}")
    comparison.extra["acceptance rate (routed blocks)"] = (
        "n/a" if math.isnan(stats.acceptance_rate) else f"{stats.acceptance_rate:.2f} of {routed}", "-")
    comparison.extra["reward calls"] = (str(stats.reward_calls), "0")
    comparison.notes = [
        f"{len(prompts)} prompt(s) x {videos} video(s), {blocks} blocks of {pipe.frames_per_block} frames, {steps} "
        f"denoising steps per block, seed {seed}.",
        "Calls count model passes (the prompt's and the denoising steps, which also write pending blocks into "
        "the cache); mean accepted length is a token-level statistic and does not apply to blocks: see the "
        "block strip.",
        "Drafter and target share each block's noise, so tau = +inf reproduces the baseline exactly and "
        "tau = -inf (first-block rule off) the drafter-only run.", CPU_NOTE]
    kinds = [[block["kind"] for block in row] for row in block_decisions(stats)]
    spec_videos, base_videos = [to_pil_list(v) for v in spec.frames], [to_pil_list(v) for v in base.frames]
    fpb = pipe.frames_per_block
    tau_value = getattr(config, "tau", math.inf)
    identical = bool(torch.equal(spec.latents, base.latents))
    comparison.lossless = method == "sdvg" and tau_value == math.inf
    comparison.quality = frame_score_quality(spec_videos, base_videos, rows_prompts)
    spec_animation = ANIMATIONS.write(animation_frames(spec_videos, kinds, fpb, videos), "speculative")
    base_animation = ANIMATIONS.write(animation_frames(base_videos, None, fpb, videos), "baseline")
    blocks_html = block_strip_html(stats, tau_value, rows_prompts, method)
    labels = [f"video {v}: {text}" for v, text in enumerate(rows_prompts)]
    return VideoResult(spec_animation, film_strip(spec_videos, kinds, fpb, labels=labels), base_animation,
                       film_strip(base_videos, None, fpb, labels=labels), blocks_html,
                       headline_html(comparison, identical=identical),
                       stats_html(comparison, show_accepted_length=False, unit="frames"), comparison)


def frame_score_quality(spec_videos: list[list[PIL.Image.Image]], base_videos: list[list[PIL.Image.Image]],
                        prompts: list[str]) -> tuple[str, str, str] | None:
    """The quality figure of a video run: the shapes world's per-frame score (the share of the prompted
    objects found in a frame, :class:`~mmspec.models.rewards.ShapesFrameReward`) averaged over every frame,
    for both sides; None when a prompt is not in the world's format (the score cannot judge it)."""
    from mmspec.models.rewards import ShapesFrameReward, parse_video_prompt

    try:
        for text in prompts:
            parse_video_prompt(text)
    except ValueError:
        return None
    reward = ShapesFrameReward()

    def mean_score(videos: list[list[PIL.Image.Image]]) -> float:
        scores = [score for frames, text in zip(videos, prompts)
                  for score in reward(np.stack([np.asarray(frame) for frame in frames]), text)]
        return float(np.mean(scores))

    return ("prompted objects found per frame (the shapes world's score)", f"{mean_score(spec_videos):.2f}",
            f"{mean_score(base_videos):.2f}")
