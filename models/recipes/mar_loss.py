"""MAR's training step for :class:`~mmspec.models.mar.MARModel`: masking, the diffusion loss, distillation.

:func:`mar_loss` masks a random share of every token set (:func:`sample_mask_ratio`), noises the masked tokens
with the full 1000-step DDPM (:func:`q_sample`), runs the model's :meth:`~mmspec.models.mar.MARModel.head_outputs`
and scores them with :func:`diffusion_loss` (improved DDPM's hybrid loss MSE + VLB, as MAR's DiffLoss),
optionally pulling the diffusion head towards a frozen teacher's. The model file holds the network and the
diffusion schedule it samples with; this module holds what only training needs.
"""

from __future__ import annotations

import math

import torch

from mmspec.models.mar import DiffusionSchedule, MARModel, diffusion_schedule


def sample_mask_ratio(model: MARModel, generator: torch.Generator | None = None) -> float:
    """MAR's masking ratio: N(1, 0.25^2) truncated to [``model.config.mask_ratio_min``, 1], by inverse CDF."""
    normal = torch.distributions.Normal(0.0, 1.0)
    low = float(normal.cdf(torch.tensor((model.config.mask_ratio_min - 1.0) / 0.25)))
    u = low + (0.5 - low) * float(torch.rand((), generator=generator))
    return 1.0 + 0.25 * float(torch.special.ndtri(torch.tensor(u, dtype=torch.float64)))


def q_sample(schedule: DiffusionSchedule, x0: torch.Tensor, i: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The forward process: ``x_i = sqrt(abar_i) x0 + sqrt(1 - abar_i) noise`` for tokens ``[N, C]`` at steps ``i``."""
    return (schedule.take(schedule.sqrt_alphas_cumprod, i, x0) * x0
            + schedule.take(schedule.sqrt_one_minus_alphas_cumprod, i, x0) * noise)


def diffusion_loss(schedule: DiffusionSchedule, model_output: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor,
                   i: torch.Tensor, noise: torch.Tensor, prediction_type: str = "epsilon") -> torch.Tensor:
    """Per-sample loss ``[N]``: MSE of the eps (or v) prediction + the variational bound (in bits per
    dimension) on the variance with the mean held fixed (improved DDPM's hybrid loss, as MAR)."""
    prediction, v = model_output.chunk(2, dim=-1)
    if prediction_type == "epsilon":
        target = noise
    else:
        target = (schedule.take(schedule.sqrt_alphas_cumprod, i, x0) * noise
                  - schedule.take(schedule.sqrt_one_minus_alphas_cumprod, i, x0) * x0)
    mse = ((prediction - target) ** 2).mean(-1)
    frozen = torch.cat([prediction.detach(), v], dim=-1)
    mean, log_var, _ = schedule.p_mean_variance(frozen, x_t, i, prediction_type=prediction_type)
    # true posterior q(x_{i-1} | x_i, x0)
    true_mean = (schedule.take(schedule.posterior_mean_coef1, i, x0) * x0
                 + schedule.take(schedule.posterior_mean_coef2, i, x0) * x_t)
    true_log_var = schedule.take(schedule.posterior_log_variance_clipped, i, x0)
    kl = 0.5 * (-1.0 + log_var - true_log_var + torch.exp(true_log_var - log_var)
                + (true_mean - mean) ** 2 * torch.exp(-log_var))
    nll = 0.5 * (math.log(2 * math.pi) + log_var + (x0 - mean) ** 2 * torch.exp(-log_var))
    vb = torch.where((i == 0).reshape(-1, 1), nll, kl).mean(-1) / math.log(2.0)
    return mse + vb


def mar_loss(model: MARModel, tokens: torch.Tensor, condition_ids: torch.Tensor,
             generator: torch.Generator | None = None, teacher: MARModel | None = None,
             distill_weight: float = 1.0) -> torch.Tensor:
    """MAR's training loss for a batch of token sets ``[B, L, C]`` and their condition ids.

    A random order per row; the last ``ceil(L * ratio)`` positions of the order are masked (one
    ratio per batch, MAR's truncated Gaussian); condition dropout with ``label_drop_prob``; the
    diffusion loss (MSE + VLB) on the masked tokens, ``diffusion_batch_mul`` noise draws each.

    With a ``teacher`` (a frozen model of the same token width and condition vocabulary, e.g. the
    target a CSpD draft serves), ``distill_weight`` times the mean squared difference between this
    model's diffusion-head outputs (prediction and variance channels) and the teacher's on the same
    masked context, condition dropout, noisy tokens and timesteps is added: CSpD accepts a drafted
    token by comparing the two heads' denoising Gaussians, so the draft learns the target's, not only
    the data's.
    """
    batch, length, channels = tokens.shape
    device = tokens.device
    num_masked = int(math.ceil(length * sample_mask_ratio(model, generator)))
    orders = torch.argsort(torch.rand(batch, length, generator=generator).to(device), dim=1)
    masked = torch.zeros(batch, length, dtype=torch.bool, device=device)
    masked.scatter_(1, orders[:, :num_masked], True)
    drop = torch.rand(batch, generator=generator).to(device) < model.config.label_drop_prob
    mul = model.config.diffusion_batch_mul
    target = tokens[masked].repeat(mul, 1)                                              # [N, C]
    schedule = diffusion_schedule(None)
    i = torch.randint(0, schedule.num_steps, (target.shape[0],), generator=generator).to(device)
    noise = torch.randn(target.shape, generator=generator, dtype=target.dtype).to(device)
    x_t = q_sample(schedule, target, i, noise)
    out = model.head_outputs(tokens, condition_ids, masked, drop, x_t, i, mul)
    loss = diffusion_loss(schedule, out, target, x_t, i, noise, model.config.prediction_type).mean()
    if teacher is None:
        return loss
    with torch.no_grad():
        reference = teacher.head_outputs(tokens, condition_ids, masked, drop, x_t, i, mul)
    return loss + distill_weight * ((out - reference) ** 2).mean()
