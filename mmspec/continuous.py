"""Speculative verification of continuous tokens (CSpD, arXiv 2411.11925).

``verify_continuous`` is the continuous counterpart of ``verify_tokens``: accept a draft sample x with
probability min(1, p(x)/q(x)) (in log space); a rejected sample is replaced by a draw from the residual
norm(max(0, p - q)), obtained by acceptance-rejection with proposal p: draw y ~ p and keep it with
probability max(0, 1 - q(y)/p(y)). That loop is bounded (``max_tries``): an element still unresolved
after the last try keeps the last proposal y ~ p, a documented bias towards p that happens with
probability (1 - TV(p, q))^max_tries per rejected element (counted in ``num_fallbacks``). Keeping a target
draw rather than a fixed value (the released CSpD code leaves a zero vector, ``exhausted_residual="zero"``)
keeps the output a sample near the target's distribution: a zero latent is a token no model would produce.

Diffusion heads have no tractable density, so CSpD scores whole denoising trajectories: with the draft
and target chains driven by the same noise, :func:`cspd_log_ratio` gives the surrogate log density ratio
(:func:`cspd_log_ratio_terms` its two terms); :func:`cspd_verify` verifies a batch of drafted tokens with it
(acceptance and residual through :func:`verify_continuous`).

NaN never decides: samples, proposals and the chains' means and variances must be finite, and log densities
must not be NaN or +inf (a log ratio of NaN would reject silently, an infinite density accept), else a
:class:`~mmspec.validation.NonFiniteValuesError` names the value and its index (check the models for NaN
weights, and the sampling temperature and guidance scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmspec.validation import NonFiniteValuesError, check_finite, check_positive_int

#: How the earlier denoising steps enter CSpD's log ratio: "gaussian_normalisers" (the paper: the Gaussian
#: normalisers of the aligned trajectories' densities, sum of log(sigma_q / sigma_p)) or "sigma_ratio_product"
#: (the released code's ``fixed_term``: the product of sigma_p / sigma_q, the opposite sign).
LOGDET_TERMS = ("gaussian_normalisers", "sigma_ratio_product")
#: How the residual loop runs: "first_accepted" (each rejected element keeps its first accepted proposal; the
#: loop ends once every rejected element has one) or "whole_batch_last_accepted" (the released code: every
#: element, accepted drafts included, runs the residual test on each try; the loop ends once each has passed
#: it at least once, and a rejected element keeps the proposal of the last try it passed).
RESIDUAL_LOOPS = ("first_accepted", "whole_batch_last_accepted")
#: What a rejected element gets when no proposal passed within ``max_tries``: "last_target_draw" (the last
#: proposal, a sample of the target) or "zero" (the released code: a zero vector).
EXHAUSTED_RESIDUALS = ("last_target_draw", "zero")

#: What non-finite continuous values usually mean.
_ADVICE = ("check the draft and target models for NaN or infinite weights, and that the sampling temperature "
           "and guidance scale are in range")


@dataclass
class ContinuousVerification:
    """Outcome of :func:`verify_continuous`.

    Attributes:
        accepted: bool, the batch shape of the distributions (``[B]`` or ``[B, K]``): per-sample test.
        num_accepted: LongTensor ``[B]``, the leading run of accepted samples along K (``[B]`` batch
            shape: 0 or 1). Chain (paper) order commits ``samples[:, :num_accepted + 1]``.
        samples: the draft samples where accepted, residual samples where rejected (same shape as input).
        num_fallbacks: how many rejected elements exhausted ``max_tries`` (then given a plain target draw,
            or zeros with ``exhausted_residual="zero"``).
    """

    accepted: torch.Tensor
    num_accepted: torch.Tensor
    samples: torch.Tensor
    num_fallbacks: int


def sample_with_generator(dist: Any, generator: torch.Generator | None, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
    """Draw from a distribution reproducibly under ``generator``.

    Gaussians (``Normal`` or ``Independent(Normal)``, or anything with ``loc``/``scale``) are drawn as
    ``loc + scale * eps`` with ``eps`` from the generator; other distributions are drawn by their own
    ``sample`` inside a forked RNG seeded from the generator.
    """
    base = dist.base_dist if isinstance(dist, torch.distributions.Independent) else dist
    if hasattr(base, "loc") and hasattr(base, "scale"):
        loc, scale = torch.broadcast_tensors(base.loc, base.scale)
        shape = tuple(sample_shape) + tuple(loc.shape)
        device = generator.device if generator is not None else loc.device
        eps = torch.randn(shape, generator=generator, dtype=loc.dtype, device=device).to(loc.device)
        return loc + scale * eps
    if generator is None:
        return dist.sample(sample_shape)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return dist.sample(sample_shape)


def verify_continuous(draft: Any, target: Any, samples: torch.Tensor, generator: torch.Generator | None = None,
                      max_tries: int = 64, *, residual_draft: Any = None, residual_target: Any = None,
                      residual_loop: str = "first_accepted",
                      exhausted_residual: str = "last_target_draw") -> ContinuousVerification:
    """Speculative sampling for continuous tokens.

    Args:
        draft, target: ``torch.distributions.Distribution``-like (``sample``, ``log_prob``) with equal
            batch shape ``[B]`` or ``[B, K]``; ``log_prob`` returns one value per batch element.
        samples: draft samples, shape ``batch_shape + event_shape``.
        max_tries: bound on residual proposals per rejected element.
        residual_draft, residual_target: the densities of the residual test (proposals drawn from
            ``residual_target``); ``None``: ``draft`` and ``target``. They differ when the acceptance test uses
            a tempered surrogate and the residual the plain one.
        residual_loop: one of :data:`RESIDUAL_LOOPS`.
        exhausted_residual: one of :data:`EXHAUSTED_RESIDUALS`.

    Random numbers, in order: one uniform per element (the acceptance test), then per try one proposal per
    element and one uniform per element (float64 uniforms).
    """
    check_positive_int(max_tries, "max_tries")
    _check_choice(residual_loop, "residual_loop", RESIDUAL_LOOPS)
    _check_choice(exhausted_residual, "exhausted_residual", EXHAUSTED_RESIDUALS)
    residual_draft = draft if residual_draft is None else residual_draft
    residual_target = target if residual_target is None else residual_target
    check_finite(samples, "samples (the draft's)", _ADVICE)
    log_p, log_q = target.log_prob(samples), draft.log_prob(samples)
    if log_p.shape != log_q.shape:
        raise ValueError(f"draft and target disagree on the batch shape: log_prob gives {tuple(log_q.shape)} "
                         f"vs {tuple(log_p.shape)}")
    if log_p.ndim not in (1, 2):
        raise ValueError(f"distributions must have batch shape [B] or [B, K], got {tuple(log_p.shape)}")
    event_dims = samples.ndim - log_p.ndim
    if tuple(samples.shape[: log_p.ndim]) != tuple(log_p.shape):
        raise ValueError(f"samples {tuple(samples.shape)} do not start with the batch shape {tuple(log_p.shape)}")
    _check_log_densities(log_p, "target log density", log_q, "draft log density")

    device = generator.device if generator is not None else samples.device
    u = torch.rand(log_p.shape, generator=generator, dtype=torch.float64, device=device).to(samples.device)
    accepted = u.log() < (log_p - log_q).double()
    out = samples.clone()
    rejected = ~accepted
    resolved = torch.zeros_like(accepted)  # rejected elements holding an accepted residual proposal
    # the elements the loop waits for: the rejected ones, or (released loop) every element once one is rejected
    whole_batch = residual_loop == "whole_batch_last_accepted"
    waiting = torch.full_like(accepted, bool(rejected.any())) if whole_batch else rejected.clone()
    proposal = None
    for _ in range(max_tries):
        if not waiting.any():
            break
        proposal = sample_with_generator(residual_target, generator)
        check_finite(proposal, "residual proposal (a target sample)", _ADVICE)
        log_p_y, log_q_y = residual_target.log_prob(proposal), residual_draft.log_prob(proposal)
        _check_log_densities(log_p_y, "target log density of a residual proposal", log_q_y,
                             "draft log density of a residual proposal")
        keep_prob = (1 - torch.exp(log_q_y - log_p_y).double()).clamp_min(0)
        v = torch.rand(log_p.shape, generator=generator, dtype=torch.float64, device=device).to(samples.device)
        passed = v < keep_prob
        take = rejected & passed & (torch.ones_like(passed) if whole_batch else ~resolved)
        out = torch.where(_expand(take, event_dims), proposal, out)
        resolved = resolved | take
        waiting = waiting & ~passed
    exhausted = rejected & ~resolved
    num_fallbacks = int(exhausted.sum())
    if num_fallbacks:
        fill = proposal if exhausted_residual == "last_target_draw" else torch.zeros_like(out)
        out = torch.where(_expand(exhausted, event_dims), fill, out)
    leading = accepted.long().cumprod(-1).sum(-1) if accepted.ndim == 2 else accepted.long()
    return ContinuousVerification(accepted, leading, out, num_fallbacks)


def _check_choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_log_densities(log_p: torch.Tensor, p_name: str, log_q: torch.Tensor, q_name: str) -> None:
    """Log densities may be -inf (a sample impossible under that side) but not NaN or +inf, and not -inf on
    both sides at once (their ratio would be NaN)."""
    for values, name in ((log_p, p_name), (log_q, q_name)):
        bad = torch.isnan(values) | (values == float("inf"))
        if bool(bad.any()):
            index = [int(i) for i in bad.nonzero()[0]]
            raise NonFiniteValuesError(f"{name} is NaN or +inf at batch index {index}: {_ADVICE}")
    both = (log_p == float("-inf")) & (log_q == float("-inf"))
    if bool(both.any()):
        index = [int(i) for i in both.nonzero()[0]]
        raise NonFiniteValuesError(f"{p_name} and {q_name} are both -inf at batch index {index} (the log "
                                   f"ratio is NaN): {_ADVICE}")


def _expand(mask: torch.Tensor, event_dims: int) -> torch.Tensor:
    return mask.reshape(*mask.shape, *([1] * event_dims))


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Diagonal Gaussian log density summed over the last dimension."""
    return (-0.5 * ((x - mean) ** 2 / var + var.log() + torch.log(torch.tensor(2 * torch.pi, dtype=x.dtype)))).sum(-1)


def cspd_log_ratio(x0: torch.Tensor, target_means: torch.Tensor, target_vars: torch.Tensor,
                   draft_means: torch.Tensor, draft_vars: torch.Tensor, *,
                   logdet_term: str = "gaussian_normalisers") -> torch.Tensor:
    """CSpD trajectory-aligned surrogate log ratio log r = log p~(x0) - log q~(x0): the sum of the two
    terms of :func:`cspd_log_ratio_terms`."""
    log_det, last_step = cspd_log_ratio_terms(x0, target_means, target_vars, draft_means, draft_vars,
                                              logdet_term=logdet_term)
    return log_det + last_step


def cspd_log_ratio_terms(x0: torch.Tensor, target_means: torch.Tensor, target_vars: torch.Tensor,
                         draft_means: torch.Tensor, draft_vars: torch.Tensor, *,
                         logdet_term: str = "gaussian_normalisers") -> tuple[torch.Tensor, torch.Tensor]:
    """The two terms of CSpD's trajectory-aligned surrogate log ratio log r = log p~(x0) - log q~(x0).

    Both denoising chains ran with the same noise at every step (trajectory alignment), step t drawing
    x_{t-1} = mu_t + sigma_t * eps_t. Under shared eps the Gaussian exponents of all steps but the last
    coincide, leaving
        log r = sum_{t >= 2} 0.5 * (log|S^q_t| - log|S^p_t|) + log N(x0; mu^p_1, S^p_1) - log N(x0; mu^q_1, S^q_1),
    with x0 the draft's final sample: each earlier step contributes its Gaussian normaliser ratio
    sigma^q_t / sigma^p_t (``logdet_term="gaussian_normalisers"``). The released code multiplies by
    sigma^p_t / sigma^q_t instead (its ``DistributionProcessor.fixed_term``; ``"sigma_ratio_product"``), the
    opposite sign: it favours drafts whose chain was narrower than the target's, where the trajectory density
    favours wider ones.

    Args:
        x0: ``[..., D]`` the draft token (output of the draft chain).
        target_means, target_vars, draft_means, draft_vars: ``[T, ..., D]`` per-step Gaussian means and
            diagonal variances of each chain in sampling order (the last entry is the step that produced
            x0). Only the variances of steps ``0..T-2`` and the last step's mean/variance enter.
        logdet_term: one of :data:`LOGDET_TERMS`.
    Returns:
        ``(log_det [...], last_step [...])``: the earlier steps' log-determinant sum (with the default,
        positive where the draft's Gaussians are wider than the target's) and the last step's log density
        difference at x0.
    """
    _check_choice(logdet_term, "logdet_term", LOGDET_TERMS)
    shapes = {t.shape for t in (target_means, target_vars, draft_means, draft_vars)}
    if len(shapes) != 1:
        raise ValueError(f"per-step means/variances of both chains must share one shape [T, ..., D], got {shapes}")
    if tuple(target_means.shape[1:]) != tuple(x0.shape):
        raise ValueError(f"x0 {tuple(x0.shape)} must match the per-step shape {tuple(target_means.shape[1:])}")
    named = (("x0", x0), ("target_means", target_means), ("target_vars", target_vars),
             ("draft_means", draft_means), ("draft_vars", draft_vars))
    for name, values in named:
        check_finite(values, name, _ADVICE)
    if not bool((target_vars > 0).all()) or not bool((draft_vars > 0).all()):
        raise ValueError("variances must be positive")
    log_det = 0.5 * (draft_vars[:-1].log() - target_vars[:-1].log()).sum(dim=(0, -1))
    if logdet_term == "sigma_ratio_product":
        log_det = -log_det
    last_step = gaussian_log_prob(x0, target_means[-1], target_vars[-1]) - gaussian_log_prob(x0, draft_means[-1], draft_vars[-1])
    return log_det, last_step


# -- CSpD's verification over recorded chains -----------------------------------------------------------------
# (the diffusion-head side of CSpD: both chains' per-step Gaussians in, the core's verification out)


class LastStepGaussian:
    """The last denoising step's diagonal Gaussian of a chain, as a distribution-like object for
    :func:`verify_continuous`.

    ``loc``/``scale`` are what the core samples residual proposals from (``loc + scale * eps``);
    ``log_prob`` evaluates the density with the standard deviation multiplied by ``density_temperature``
    (1: the plain Gaussian; the official code's "inner temperature" otherwise) plus ``log_offset`` (the
    target side carries CSpD's log-determinant sum over the earlier steps).
    """

    def __init__(self, loc: torch.Tensor, variance: torch.Tensor, density_temperature: float = 1.0,
                 log_offset: torch.Tensor | float = 0.0) -> None:
        self.loc = loc
        self.scale = variance.sqrt()
        self.density_variance = variance * density_temperature ** 2
        self.log_offset = log_offset

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return gaussian_log_prob(x, self.loc, self.density_variance) + self.log_offset


def cspd_verify(draft_x0: torch.Tensor, draft_means: torch.Tensor, draft_vars: torch.Tensor,
                target_means: torch.Tensor, target_vars: torch.Tensor, generator: torch.Generator | None = None,
                density_temperature: float = 1.0, max_tries: int = 64, *,
                logdet_term: str = "gaussian_normalisers", temper_residual: bool = True,
                residual_loop: str = "first_accepted",
                exhausted_residual: str = "last_target_draw") -> ContinuousVerification:
    """Verify drafted continuous tokens against the target's aligned chains (core calls only).

    Args:
        draft_x0: ``[N, C]`` drafted tokens (the draft chains' outputs).
        draft_means, draft_vars, target_means, target_vars: ``[T, N, C]`` every step's Gaussian of the
            two chains run with the same noise (variances include the sampling temperature).
        density_temperature: multiplies the standard deviation of the last-step densities (1 = CSpD's
            surrogate as specified).
        logdet_term: how the earlier steps enter the ratio (:data:`LOGDET_TERMS`).
        temper_residual: whether the residual test uses the tempered densities too (True) or the plain
            last-step Gaussians (False: the released code, which applies its inner temperature to the
            acceptance test only).
        residual_loop, exhausted_residual: how the residual loop runs and what an element gets when it
            exhausts ``max_tries`` (:func:`verify_continuous`).
    Returns:
        :class:`ContinuousVerification` (batch shape ``[N]``): ``accepted``,
        ``samples`` (drafts where accepted, residual samples where rejected), ``num_fallbacks``; plus
        ``log_ratio`` ``[N]`` and its two terms ``log_det`` and ``last_step`` (``cspd_log_ratio_terms``)
        attached as attributes.

    The surrogate log ratio is :func:`cspd_log_ratio` (log-determinants of
    steps 1..T-1 plus the last-step Gaussians at the draft token, tempered). The target's
    distribution object carries the log-determinant sum as a constant offset, so the core's
    ``log p(x) - log q(x)`` at the draft token is exactly that ratio, and its residual draws y from the
    target's last-step Gaussian and keeps y with probability ``max(0, 1 - 1 / r(y))`` (r tempered unless
    ``temper_residual=False``).
    """
    if not isinstance(temper_residual, bool):
        raise ValueError(f"temper_residual must be a bool, got {temper_residual!r}")
    factor = torch.ones(draft_vars.shape[0], 1, 1, dtype=draft_vars.dtype, device=draft_vars.device)
    factor[-1] = density_temperature ** 2
    log_det, last_step = cspd_log_ratio_terms(draft_x0, target_means, target_vars * factor, draft_means,
                                              draft_vars * factor, logdet_term=logdet_term)
    target = LastStepGaussian(target_means[-1], target_vars[-1], density_temperature, log_det)
    draft = LastStepGaussian(draft_means[-1], draft_vars[-1], density_temperature)
    residual_target = residual_draft = None
    if not temper_residual and density_temperature != 1.0:
        residual_target = LastStepGaussian(target_means[-1], target_vars[-1], 1.0, log_det)
        residual_draft = LastStepGaussian(draft_means[-1], draft_vars[-1], 1.0)
    result = verify_continuous(draft, target, draft_x0, generator=generator, max_tries=max_tries,
                               residual_draft=residual_draft, residual_target=residual_target,
                               residual_loop=residual_loop, exhausted_residual=exhausted_residual)
    result.log_ratio, result.log_det, result.last_step = log_det + last_step, log_det, last_step
    return result
