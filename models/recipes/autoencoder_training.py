"""Training of the continuous patch tokenizer (:class:`~mmspec.models.tokenizers.ContinuousTokenizer`).

:func:`train_autoencoder` fits the per-patch autoencoder with MSE and injects Gaussian noise of 10 % of each
latent channel's spread before decoding, so the decoder stays smooth around the latents it was trained on: a
generator's imperfect latents still decode to clean shapes. It then measures the latent statistics the
tokenizer standardises with. The model file holds the network; this module holds what only training needs.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from mmspec.models.tokenizers import ContinuousTokenizer


def train_autoencoder(
    model: ContinuousTokenizer,
    patches: torch.Tensor,
    steps: int = 3000,
    batch_size: int = 1024,
    lr: float = 2e-3,
    latent_noise: float = 0.1,
    seed: int = 0,
    log_every: int = 0,
) -> list[float]:
    """Fit the autoencoder on patches [N, D] (values in [0, 1]) with MSE; sets the latent statistics.

    Deterministic for a seed (and thread count). Adam with cosine learning-rate decay; noise of
    ``latent_noise`` times each latent channel's batch standard deviation is added before decoding.
    Returns the loss of every step.
    """
    if patches.ndim != 2 or patches.shape[1] != model.patch_dim:
        raise ValueError(f"patches must have shape [N, {model.patch_dim}], got {tuple(patches.shape)}")
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    for p in model.parameters():  # re-initialise deterministically
        if p.ndim == 2:
            nn.init.xavier_uniform_(p, generator=g)
        else:
            nn.init.zeros_(p)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    model.train()
    losses = []
    start = time.time()
    for step in range(steps):
        idx = torch.randint(patches.shape[0], (batch_size,), generator=g)
        x = patches[idx]
        z = model.encode_raw(x)
        noise = torch.randn(z.shape, generator=g) * z.detach().std(0, keepdim=True) * latent_noise
        loss = ((model.decode_raw(z + noise) - x) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"  autoencoder step {step + 1}/{steps}: mse {sum(losses[-log_every:]) / log_every:.5f} "
                  f"({time.time() - start:.0f}s)", flush=True)
    model.eval()
    with torch.no_grad():
        z = torch.cat([model.encode_raw(part) for part in patches.split(65536)])
        model.latent_mean.copy_(z.mean(0))
        model.latent_std.copy_(z.std(0).clamp(min=1e-6))
    return losses
