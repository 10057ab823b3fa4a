"""Block-wise autoregressive video generation: the one loop that every video method runs.

A video is generated block by block; each block is denoised in a few steps against a KV cache of the prompt
and of the previous final blocks (the causal video model interface of :mod:`mmspec.models.video`).
:func:`generate_blocks` makes every block in one of three ways:

* no drafter: the target makes every block (target-only decoding, the baseline);
* a :class:`VideoDrafter` and no router: the drafter makes every block (draft-only, the quality floor);
* a drafter and a :class:`~mmspec.reward.RewardRouter` (SDVG): the drafter proposes each block, the router
  decodes and scores it and keeps it iff its aggregated reward reaches tau; the target regenerates the
  rejected videos' block (from its noise, or refining the rejected draft from ``refine_rejected_from``).

Every final block (accepted draft or target block) enters both models' caches at t=0, so the target
conditions on accepted drafts exactly as on its own blocks. Both caches are brought up to date lazily and
without passes of their own: the frames a model has not cached yet ride along in its next denoising pass
(``pending_clean``, the same keys and values as a block-causal ``write_cache`` pass). Only when the target
regenerates some videos of a batch and not others do the pending blocks get a write pass of their own;
``lazy_target_cache=False`` writes every final block into the target's cache by its own pass right away.

Every method draws the same noise per block from the generator, in the same order, and drafter and target
of a block share it: a router that rejects everything gives exactly target-only decoding, one that accepts
everything (no forced first block) exactly draft-only decoding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mmspec.models.video import NUM_TRAIN_TIMESTEPS, denoise_block, noised_to
from mmspec.reward import RewardRouter
from mmspec.stats import SpecStats
from mmspec.validation import check_count

SAMPLERS = ("euler", "renoise")


@dataclass
class VideoSpecStats(SpecStats):
    """:class:`~mmspec.stats.SpecStats` of a video call plus the per-block routing record.

    ``tokens`` counts generated frames (all videos, not a given context); ``target_calls`` /
    ``draft_calls`` count model passes (the prompt's, the denoising steps, and the write passes of their own
    that only ``lazy_target_cache=False`` and partial-batch regenerations need); ``phase_seconds`` has
    "target", "draft", "cache" (prompts and write passes of their own), "decode", "reward". The token-level
    fields (``verify_steps``, ``mean_accepted_length``) are unused (0).

    Attributes:
        source: per video and block, who made the final block: ``"target"``, ``"draft"`` or ``"context"``
            (``[B][N]``).
        accepted: bool ``[B, N]``: the block is the drafter's (drafted and accepted, or draft-only).
        routed: bool ``[B, N]``: a drafted block went through the router.
        scored: bool ``[B, N]``: the reward model scored the drafted block.
        block_scores: ``[B, N]`` aggregated reward of each drafted block (NaN where not scored).
        frame_rewards: ``[B, F]`` per-frame rewards of the drafted frames (NaN where not scored).
        reward_calls: calls of the reward callable (one per scored video block).
    """

    source: list[list[str]] = field(default_factory=list)
    accepted: torch.Tensor | None = None
    scored: torch.Tensor | None = None
    block_scores: torch.Tensor | None = None
    frame_rewards: torch.Tensor | None = None
    reward_calls: int = 0
    routed: torch.Tensor | None = None

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted-and-routed blocks that were accepted (blocks whose decision needed no draft,
        such as a forced first block, are excluded); NaN when no block was routed."""
        if self.accepted is None or self.routed is None or not self.routed.any():
            return float("nan")
        return float(self.accepted[self.routed].float().mean())

    @property
    def draft_fraction(self) -> float:
        """Fraction of all blocks that come from the drafter."""
        return float(self.accepted.float().mean()) if self.accepted is not None and self.accepted.numel() else 0.0

    def __str__(self) -> str:
        return (f"VideoSpecStats(frames={self.tokens}, target_calls={self.target_calls}, draft_calls={self.draft_calls}, "
                f"draft_fraction={self.draft_fraction:.2f}, acceptance_rate={self.acceptance_rate:.2f}, "
                f"reward_calls={self.reward_calls}, wall={self.wall_seconds:.3f}s)")

    def as_dict(self) -> dict:
        out = super().as_dict()
        out.update({"acceptance_rate": self.acceptance_rate, "draft_fraction": self.draft_fraction,
                    "reward_calls": self.reward_calls, "source": self.source,
                    "block_scores": None if self.block_scores is None else self.block_scores.tolist()})
        return out


@dataclass
class VideoBlocksOutput:
    """What :func:`generate_blocks` returns: the final latents ``[B, F, C, h, w]`` (a context first) and the
    call's :class:`VideoSpecStats`."""

    latents: torch.Tensor
    stats: VideoSpecStats


def evenly_spaced_timesteps(num_steps: int, name: str) -> list[float]:
    """``num_steps`` timesteps evenly spaced from 1000 (4: 1000/750/500/250; 1: 1000); ``name`` is the argument's
    name for the error. At most one step per training timestep (1000): more would only repeat fractions of the
    same noise levels, and 10**5 steps per block run for hours."""
    check_count(num_steps, name, NUM_TRAIN_TIMESTEPS)
    return [NUM_TRAIN_TIMESTEPS * (1 - k / num_steps) for k in range(num_steps)]


@dataclass(frozen=True)
class VideoDrafter:
    """The drafting model of a video call and how it samples.

    Attributes:
        model: a causal video model with the target's latent format, blocks and prompt layout.
        num_inference_steps: its denoising steps per block, evenly spaced from 1000 and at most the target's
            (it starts from the block's shared noise); None: the target's timesteps.
        guidance_scale: its classifier-free guidance; None: the target's.
    """

    model: Any
    num_inference_steps: int | None = None
    guidance_scale: float | None = None

    def timesteps(self, target_timesteps: Sequence[float]) -> list[float]:
        """The drafter's timesteps for a call whose target denoises at ``target_timesteps``."""
        if self.num_inference_steps is None:
            return list(target_timesteps)
        steps = evenly_spaced_timesteps(self.num_inference_steps, "draft_num_inference_steps")
        if len(steps) > len(target_timesteps):
            raise ValueError(f"draft_num_inference_steps={self.num_inference_steps} exceeds the target's "
                             f"{len(target_timesteps)} steps (a drafter is meant to be cheaper; the block's noise has "
                             f"one draw per target step)")
        return steps


def refine_index(refine_rejected_from: float | None, timesteps: Sequence[float]) -> int | None:
    """Index of ``refine_rejected_from`` among the target's ``timesteps`` (None: no refinement; 0: the first
    timestep, which is pure noise, i.e. the same as None)."""
    if refine_rejected_from is None:
        return None
    try:
        value = float(refine_rejected_from)
    except (TypeError, ValueError):
        value = math.nan  # in no list of timesteps
    if value not in timesteps:
        raise ValueError(f"refine_rejected_from must be None or one of the target's timesteps {list(timesteps)}, "
                         f"got {refine_rejected_from!r} (a setting of the method's config: pass "
                         "method=pipe.method_config('sdvg').replace(refine_rejected_from=...) with one of them, or "
                         "denoising steps whose timesteps include it)")
    return list(timesteps).index(value)


def new_cache(model: Any, prompt_ids: torch.Tensor, guidance_scale: float) -> Any:
    """A cache of ``model`` holding the prompts (and the null prompt's rows under guidance)."""
    if guidance_scale != 1.0:
        prompt_ids = torch.cat([prompt_ids, torch.full_like(prompt_ids, -1)])  # unconditional rows: the null prompt
    cache = model.new_cache(prompt_ids.shape[0])
    model.encode_prompt(cache, prompt_ids.to(model.device))
    return cache


def pending_frames(model: Any, cache: Any, video: torch.Tensor, upto: int) -> torch.Tensor | None:
    """The final frames ``video[:, cache.num_frames:upto]`` the cache does not hold yet (None: none), in the
    model's dtype: written by the model's next pass (``pending_clean``) or by :func:`catch_up`."""
    start = cache.num_frames
    return video[:, start:upto].to(model.dtype) if start < upto else None


def catch_up(model: Any, cache: Any, video: torch.Tensor, upto: int, guidance_scale: float) -> int:
    """Write the pending frames up to ``upto`` into ``cache`` in a pass of their own (both halves under
    guidance). Returns the passes made (0 or 1)."""
    clean = pending_frames(model, cache, video, upto)
    if clean is None:
        return 0
    model.write_cache(clean if guidance_scale == 1.0 else torch.cat([clean, clean]), cache, cache.num_frames)
    return 1


class _Caches:
    """Each model's cache, built on first use (a method that never needs a model never runs it)."""

    def __init__(self, models: dict[str, Any], prompt_ids: torch.Tensor, scales: dict[str, float],
                 stats: VideoSpecStats) -> None:
        self.models, self.prompt_ids, self.scales, self.stats = models, prompt_ids, scales, stats
        self.built: dict[str, Any] = {}

    def __call__(self, role: str) -> Any:
        if role not in self.built:
            with self.stats.phase("cache"):
                self.built[role] = new_cache(self.models[role], self.prompt_ids, self.scales[role])
            if role == "target":
                self.stats.target_calls += 1
            else:
                self.stats.draft_calls += 1
        return self.built[role]


def generate_blocks(target: Any, drafter: VideoDrafter | None, prompt_ids: torch.Tensor, *, num_blocks: int,
                    timesteps: Sequence[float], sampler: str = "euler", guidance_scale: float = 1.0,
                    generator: torch.Generator | None = None, context: torch.Tensor | None = None,
                    decode: Callable[[torch.Tensor], torch.Tensor] | None = None, prompts: Sequence[Any] = (),
                    callback: Callable[[int, dict[str, Any]], Any] | None = None,
                    router: RewardRouter | None = None, refine_rejected_from: float | None = None,
                    lazy_target_cache: bool = True) -> VideoBlocksOutput:
    """Generate videos block by block (see the module docstring for the three ways).

    Args:
        target: the target causal video model (its config gives the blocks and latent shape).
        drafter: the drafting model and its sampling (None: target-only).
        prompt_ids: word ids ``[B, L]`` of every video (one row per video).
        num_blocks: blocks per video, a context's included.
        timesteps: the target's denoising timesteps, decreasing in (0, 1000].
        sampler: "euler" or "renoise" (:func:`~mmspec.models.video.denoise_block`).
        guidance_scale: the target's classifier-free guidance (the drafter's unless it has its own).
        generator: the source of every block's noise.
        context: latents ``[B, K, C, h, w]`` of whole blocks the videos continue (cached like generated ones).
        decode: latents ``[B, F, C, h, w]`` -> frames ``[B, F, 3, H, W]`` in [0, 1], for the router's reward.
        prompts: the prompt of each video, handed to the router's reward.
        callback: ``fn(block_index, {"latents": [B, F, C, h, w] so far, "accepted": bool [B], "target_cache",
            "draft_cache"})`` after every generated block; returning True ends the loop there (an interrupted
            call: the output and its statistics hold the blocks generated so far).
        router: SDVG's reward router (needs a drafter and ``decode``); None with a drafter: draft-only.
        refine_rejected_from: with a router, one of the target's timesteps below the first: the target refines
            a rejected draft from it (the draft noised back along its path to the block's noise) instead of
            redrawing the block from noise; blocks never drafted are always drawn from noise.
        lazy_target_cache: with a router, write accepted blocks into the target's cache inside its next
            denoising pass (False: by a pass of their own right after each block).
    Returns:
        :class:`VideoBlocksOutput`.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {list(SAMPLERS)}, got {sampler!r}")
    if router is not None and (drafter is None or decode is None):
        raise ValueError("a reward router routes drafted blocks: it needs a drafter and a decode function")
    timesteps = list(timesteps)
    draft_timesteps = drafter.timesteps(timesteps) if drafter is not None else []
    refine_at = refine_index(refine_rejected_from, timesteps) if router is not None else None
    models = {"target": target, "draft": None if drafter is None else drafter.model}
    draft_scale = guidance_scale if drafter is None or drafter.guidance_scale is None else drafter.guidance_scale
    stats = VideoSpecStats()
    caches = _Caches(models, prompt_ids, {"target": guidance_scale, "draft": draft_scale}, stats)
    fb = int(target.config.frames_per_block)
    batch, (c, h, w) = prompt_ids.shape[0], target.latent_shape
    num_frames = num_blocks * fb
    accepted = torch.zeros(batch, num_blocks, dtype=torch.bool)
    routed = torch.zeros(batch, num_blocks, dtype=torch.bool)
    scored = torch.zeros(batch, num_blocks, dtype=torch.bool)
    block_scores = torch.full((batch, num_blocks), float("nan"), dtype=torch.float64)
    frame_rewards = torch.full((batch, num_frames), float("nan"), dtype=torch.float64)
    video = torch.zeros(batch, num_frames, c, h, w,
                        dtype=torch.float64 if target.dtype == torch.float64 else torch.float32)  # final latents
    start_block = 0
    if context is not None:
        start_block = context.shape[1] // fb
        video[:, :context.shape[1]] = context.to(video.dtype)
    draft_only = drafter is not None and router is None

    for n in range(start_block, num_blocks):
        frame, last = n * fb, n + 1 == num_blocks
        # the block's noise: drawn in every method in the same order, shared by drafter and target
        noise = torch.randn((len(timesteps), batch, fb, c, h, w), generator=generator)
        final = None
        # 1. the drafter's block, unless the router's decision is known to be "reject" without it
        forced = router is not None and ((router.force_reject_first and n == 0) or router.tau == math.inf)
        if drafter is not None and not forced:
            cache = caches("draft")
            with stats.phase("draft"):  # its first pass also writes the blocks the drafter has not cached
                final = denoise_block(drafter.model, cache, frame, noise[:len(draft_timesteps)].to(drafter.model.dtype),
                                      draft_timesteps, sampler, None, draft_scale,
                                      pending_clean=pending_frames(drafter.model, cache, video, frame))
            stats.draft_calls += len(draft_timesteps)
            accepted[:, n] = True
        # 2. the reward router decides per video
        if router is not None:
            pixels = None
            if not forced and not router.skips_scoring(n):
                with stats.phase("decode"):
                    pixels = decode(final)
            with stats.phase("reward"):
                decision = router(pixels, list(prompts), n, fb, batch)
            accepted[:, n] = decision.accept
            routed[:, n] = not forced
            scored[:, n] = ~torch.isnan(decision.score)
            block_scores[:, n] = decision.score.double()
            frame_rewards[:, frame:frame + fb] = decision.frame_rewards.double()
        # 3. the target regenerates the rejected videos' block
        rejected = (~accepted[:, n]).nonzero().flatten()
        if not draft_only and len(rejected):
            final = _target_block(target, caches("target"), video, frame, noise, timesteps, sampler, guidance_scale,
                                  rejected, final, refine_at, stats)
        video[:, frame:frame + fb] = final.to(video.dtype)
        if router is not None and not lazy_target_cache and not last:
            cache = caches("target")
            with stats.phase("cache"):
                stats.target_calls += catch_up(target, cache, video, frame + fb, guidance_scale)
        if callback is not None and callback(n, {"latents": video[:, :frame + fb], "accepted": accepted[:, n].clone(),
                                                 "target_cache": caches.built.get("target"),
                                                 "draft_cache": caches.built.get("draft")}) is True:
            num_blocks = n + 1  # stopped: what follows describes the blocks generated so far
            break

    video, frame_rewards = video[:, :num_blocks * fb], frame_rewards[:, :num_blocks * fb]
    accepted, routed, scored, block_scores = (values[:, :num_blocks] for values in (accepted, routed, scored,
                                                                                     block_scores))
    stats.tokens = batch * (num_blocks - start_block) * fb  # generated frames (a context is not generated)
    stats.source = [["context" if k < start_block else "draft" if a else "target" for k, a in enumerate(row)]
                    for row in accepted.tolist()]
    stats.accepted, stats.routed, stats.scored = accepted, routed, scored
    stats.block_scores, stats.frame_rewards = block_scores, frame_rewards
    stats.reward_calls = int(scored.sum())  # the router scores every video of a scored block, one call each
    return VideoBlocksOutput(video, stats)


def _target_block(target: Any, cache: Any, video: torch.Tensor, frame: int, noise: torch.Tensor,
                  timesteps: list[float], sampler: str, guidance_scale: float, rejected: torch.Tensor,
                  drafted: torch.Tensor | None, refine_at: int | None, stats: VideoSpecStats) -> torch.Tensor:
    """The block at ``frame`` with the ``rejected`` videos' rows made by the target (all rows when ``drafted``
    is None), refined from their drafts when ``refine_at`` is a timestep index."""
    batch = video.shape[0]
    rows = None if len(rejected) == batch else rejected
    pending = None  # the accepted blocks the target has not cached: written by its first pass...
    if rows is None:
        pending = pending_frames(target, cache, video, frame)
    else:  # ...which cannot also skip the accepted videos' rows: they get a pass of their own
        with stats.phase("cache"):
            stats.target_calls += catch_up(target, cache, video, frame, guidance_scale)
    block_noise = (noise if rows is None else noise[:, rejected]).to(target.dtype)
    target_timesteps, start = timesteps, None
    if refine_at and drafted is not None:  # refine the rejected drafts instead of redrawing them
        target_timesteps = timesteps[refine_at:]
        start = noised_to(drafted if rows is None else drafted[rejected], block_noise[0], target_timesteps[0])
        block_noise = block_noise[refine_at:]  # the renoise sampler's fresh noise of those steps
    with stats.phase("target"):
        regenerated = denoise_block(target, cache, frame, block_noise, target_timesteps, sampler, rows,
                                    guidance_scale, start=start, pending_clean=pending)
    stats.target_calls += len(target_timesteps)
    if drafted is None:
        return regenerated
    final = drafted.to(video.dtype).clone()
    final[rejected] = regenerated.to(video.dtype)
    return final
