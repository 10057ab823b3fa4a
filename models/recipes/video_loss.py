"""Flow-matching training loss of :class:`~mmspec.models.video.BlockCausalVideoTransformer`.

:func:`flow_matching_loss` noises every block of a clip to its own timestep (:func:`noised_blocks`) and
regresses the model's teacher-forced velocity (``forward_train``) onto ``eps - x0``. Its context blocks are
the ground truth, or for a share of the clips the model's own one-shot predictions (:func:`predicted_context`)
or its own rollout (:func:`rollout_context`), so the model learns to continue from imperfect blocks as it must
at inference; ``noise=`` trains on a sampler's noise/video coupling (reflow). The model file holds the network
and its samplers; this module holds what only training needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mmspec.models.video import (
    DEFAULT_TIMESTEPS,
    NUM_TRAIN_TIMESTEPS,
    BlockCausalVideoTransformer,
    roll_out,
)


def noised_blocks(model: BlockCausalVideoTransformer, clean: torch.Tensor, timesteps: torch.Tensor,
                  generator: torch.Generator | None = None, noise: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flow-matching noising of every block to its own timestep: ``timesteps [B, N]`` (0-1000) -> per-frame
    ``t [B, F, 1, 1, 1]`` (in [0, 1]), the noise ``eps`` and ``x_t = (1 - t) clean + t eps``. ``noise`` (same
    shape as ``clean``) is used as ``eps`` instead of fresh noise: a coupling of noise and clean latents (the
    noise a sampler started from and what it produced), as reflow training needs."""
    t = (timesteps / NUM_TRAIN_TIMESTEPS).repeat_interleave(model.config.frames_per_block, 1)[..., None, None, None]
    if noise is None:
        eps = torch.randn(clean.shape, generator=generator).to(clean)
    elif noise.shape != clean.shape:
        raise ValueError(f"noise must have the clean latents' shape {tuple(clean.shape)}, got {tuple(noise.shape)}")
    else:
        eps = noise.to(clean)
    return t, eps, (1 - t) * clean + t * eps


def check_context_shares(self_context: float, rollout: float) -> None:
    """The shares of clips trained on predicted / rolled-out context: each in [0, 1], their sum <= 1."""
    if not (0.0 <= self_context <= 1.0 and 0.0 <= rollout <= 1.0 and self_context + rollout <= 1.0):
        raise ValueError(f"self_context and rollout must be shares in [0, 1] with a sum <= 1, got {self_context} "
                         f"and {rollout}")


@torch.no_grad()
def predicted_context(model: BlockCausalVideoTransformer, clean: torch.Tensor, prompt_ids: torch.Tensor,
                      timesteps: Sequence[float], generator: torch.Generator | None = None) -> torch.Tensor:
    """The model's own one-shot predictions of every block, to stand in for the ground-truth context.

    Each block of ``clean`` is noised to a timestep drawn from ``timesteps`` and the model predicts its clean
    version (x0 = x_t - t v) in one teacher-forced pass, every block given the ground-truth blocks before it.
    At inference the context is the model's own last x0 prediction (from t = 250 with 4 steps), blurrier
    than the data, and errors compound block after block; training on these predictions teaches the model
    to continue (and redraw sharply) from its own imperfect blocks instead of copying their flaws.
    """
    b, num = clean.shape[:2]
    blocks = num // model.config.frames_per_block
    choices = torch.tensor([float(t) for t in timesteps])
    steps = choices[torch.randint(0, len(choices), (b, blocks), generator=generator)].to(clean.device)
    t, _, noisy = noised_blocks(model, clean, steps, generator)
    return (noisy - t * model.forward_train(clean, noisy, steps, prompt_ids).to(clean)).detach()


@torch.no_grad()
def rollout_context(model: BlockCausalVideoTransformer, clean: torch.Tensor, prompt_ids: torch.Tensor,
                    timesteps: Sequence[float] = DEFAULT_TIMESTEPS, generator: torch.Generator | None = None,
                    guidance_scale: float = 1.0) -> torch.Tensor:
    """A context made by the model's own sampler: the real first block, then every later block sampled by
    the model block by block against its KV cache (Euler, ``timesteps``, ``guidance_scale``), as at
    inference (an unguided rollout of a small model draws almost nothing: use the inference guidance).

    Unlike :func:`predicted_context`, errors compound here as they do in a real rollout. The last block is
    never context, so it is not sampled.
    """
    out = clean.clone()
    roll_out(model, out, prompt_ids, model.config.frames_per_block, clean.shape[1] - model.config.frames_per_block,
              timesteps, generator, guidance_scale)
    return out


def flow_matching_loss(model: BlockCausalVideoTransformer, clean: torch.Tensor, prompt_ids: torch.Tensor,
                       generator: torch.Generator | None = None, fixed_timesteps: Sequence[float] = DEFAULT_TIMESTEPS,
                       fixed_fraction: float = 0.5, self_context: float = 0.0,
                       context_timesteps: Sequence[float] = (250.0, 500.0, 750.0),
                       rollout: float = 0.0, rollout_guidance: float = 1.0,
                       noise: torch.Tensor | None = None) -> torch.Tensor:
    """MSE between predicted and true velocity, per-block timesteps: with probability ``fixed_fraction``
    one of the sampling timesteps (what inference uses), otherwise uniform in (0, 1000].

    ``noise``: the noise paired with each clean block (``[B, F, C, h, w]``, e.g. from
    :func:`sample_with_noise`) instead of fresh noise: reflow training on a sampler's coupling, whose
    straight paths few-step sampling follows well.

    ``self_context``: the share of clips whose context is the model's own prediction of it
    (:func:`predicted_context`, from a timestep in ``context_timesteps``) instead of the ground truth; the
    loss still asks for the ground truth's velocity, so the model learns to continue from imperfect blocks.
    Costs one extra forward pass without gradients when > 0. ``rollout``: the share of (other) clips whose
    context is the model's own rollout from the real first block (:func:`rollout_context`: compounding
    errors, one sampled block after another, under ``rollout_guidance``; costs a few passes per block).
    """
    check_context_shares(self_context, rollout)
    b, num = clean.shape[:2]
    blocks = num // model.config.frames_per_block
    uniform = torch.rand(b, blocks, generator=generator) * NUM_TRAIN_TIMESTEPS
    fixed = torch.tensor(list(fixed_timesteps), dtype=torch.float32)
    pick = fixed[torch.randint(0, len(fixed), (b, blocks), generator=generator)]
    use_fixed = torch.rand(b, blocks, generator=generator) < fixed_fraction
    timesteps = torch.where(use_fixed, pick, uniform).clamp_min(1.0).to(clean.device)
    t, eps, noisy = noised_blocks(model, clean, timesteps, generator, noise)
    context = clean
    if (self_context > 0 or rollout > 0) and blocks > 1:
        draw = torch.rand(b, generator=generator).to(clean.device)
        predicted, rolled = draw < self_context, (draw >= self_context) & (draw < self_context + rollout)
        context = clean.clone()
        if predicted.any():
            context[predicted] = predicted_context(model, clean[predicted], prompt_ids[predicted], context_timesteps,
                                                   generator)
        if rolled.any() and blocks > 2:
            context[rolled] = rollout_context(model, clean[rolled], prompt_ids[rolled], fixed_timesteps, generator,
                                              rollout_guidance)
    pred = model.forward_train(context, noisy, timesteps, prompt_ids)
    return F.mse_loss(pred.float(), (eps - clean).float())
