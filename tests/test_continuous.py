"""Continuous speculative verification (CSpD core): losslessness on Gaussians, residual sampler, ratio."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats as scipy_stats
from torch.distributions import Independent, Normal

from mmspec import cspd_log_ratio, verify_continuous
from mmspec.continuous import gaussian_log_prob, sample_with_generator


def test_accepted_or_resampled_output_follows_the_target_1d():
    """KS test on 2*10^5 samples: output ~ N(1, 0.8^2) whatever the draft N(0, 1.2^2) proposes."""
    n = 200_000
    g = torch.Generator().manual_seed(0)
    target = Normal(torch.full((n,), 1.0, dtype=torch.float64), torch.full((n,), 0.8, dtype=torch.float64))
    draft = Normal(torch.zeros(n, dtype=torch.float64), torch.full((n,), 1.2, dtype=torch.float64))
    result = verify_continuous(draft, target, sample_with_generator(draft, g), generator=g)
    ks = scipy_stats.kstest(result.samples.numpy(), "norm", args=(1.0, 0.8))
    assert ks.pvalue > 1e-4
    assert result.num_fallbacks == 0
    # acceptance rate = 1 - TV(p, q) for exact speculative sampling
    xs = torch.linspace(-8, 8, 200_001, dtype=torch.float64)
    tv = 0.5 * (Normal(1.0, 0.8).log_prob(xs).exp() - Normal(0.0, 1.2).log_prob(xs).exp()).abs().sum() * (xs[1] - xs[0])
    assert result.accepted.double().mean().item() == pytest.approx(1 - tv.item(), abs=0.005)


def test_batched_chain_and_moments_multivariate():
    """[B, K] batch with 4-D events: per-dimension mean and variance of the output match the target."""
    b, k, d = 20_000, 3, 4
    g = torch.Generator().manual_seed(1)
    mu_p = torch.randn(k, d, generator=g, dtype=torch.float64)
    target = Independent(Normal(mu_p.expand(b, k, d), torch.full((b, k, d), 0.5, dtype=torch.float64)), 1)
    draft = Independent(Normal((mu_p + 0.3).expand(b, k, d), torch.full((b, k, d), 0.6, dtype=torch.float64)), 1)
    result = verify_continuous(draft, target, sample_with_generator(draft, g), generator=g)
    assert result.accepted.shape == (b, k) and result.samples.shape == (b, k, d)
    mean, var = result.samples.mean(0), result.samples.var(0)
    se = 0.5 / math.sqrt(b)
    assert (mean - mu_p).abs().max() < 5 * se
    assert (var - 0.25).abs().max() < 0.02
    leading = result.accepted.long().cumprod(-1).sum(-1)
    assert torch.equal(result.num_accepted, leading)


def test_identical_distributions_accept_everything():
    g = torch.Generator().manual_seed(0)
    dist = Normal(torch.zeros(1000, dtype=torch.float64), torch.ones(1000, dtype=torch.float64))
    samples = sample_with_generator(dist, g)
    result = verify_continuous(dist, dist, samples, generator=g)
    assert result.accepted.all() and torch.equal(result.samples, samples)


def test_residual_sampler_matches_the_residual_density():
    """Rejected elements are drawn from norm(max(0, p - q)); compare with a grid-integrated CDF."""
    n = 100_000
    g = torch.Generator().manual_seed(2)
    target = Normal(torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64))
    draft = Normal(torch.full((n,), 0.7, dtype=torch.float64), torch.ones(n, dtype=torch.float64))
    result = verify_continuous(draft, target, sample_with_generator(draft, g), generator=g)
    rejected = result.samples[~result.accepted].numpy()
    xs = torch.linspace(-9, 9, 90_001, dtype=torch.float64)
    p = Normal(0.0, 1.0).log_prob(xs).exp()
    q = Normal(0.7, 1.0).log_prob(xs).exp()
    residual = (p - q).clamp_min(0)
    cdf = (residual.cumsum(0) / residual.sum()).numpy()
    ks = scipy_stats.kstest(rejected, lambda x: torch.from_numpy(cdf)[torch.searchsorted(xs, torch.as_tensor(x)).clamp(max=len(xs) - 1)].numpy())
    assert ks.pvalue > 1e-4


def test_fallback_is_counted_when_tries_run_out():
    n = 2000
    g = torch.Generator().manual_seed(3)
    target = Normal(torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64))
    draft = Normal(torch.full((n,), 0.05, dtype=torch.float64), torch.ones(n, dtype=torch.float64))
    samples = torch.full((n,), 3.0, dtype=torch.float64)  # p/q < 1 there: some rejections
    result = verify_continuous(draft, target, samples, generator=g, max_tries=1)
    rejected = int((~result.accepted).sum())
    assert rejected > 0 and 0 < result.num_fallbacks <= rejected


def test_cspd_log_ratio():
    g = torch.Generator().manual_seed(0)
    steps, batch, d = 5, 3, 4
    means = torch.randn(steps, batch, d, generator=g, dtype=torch.float64)
    variances = torch.rand(steps, batch, d, generator=g, dtype=torch.float64) + 0.1
    x0 = torch.randn(batch, d, generator=g, dtype=torch.float64)
    # identical chains: ratio 1
    assert torch.allclose(cspd_log_ratio(x0, means, variances, means, variances), torch.zeros(batch, dtype=torch.float64))
    # closed form with different variances
    v2 = variances * 1.5
    expected = 0.5 * (v2[:-1].log() - variances[:-1].log()).sum(dim=(0, -1)) \
        + gaussian_log_prob(x0, means[-1], variances[-1]) - gaussian_log_prob(x0, means[-1], v2[-1])
    assert torch.allclose(cspd_log_ratio(x0, means, variances, means, v2), expected)
    with pytest.raises(ValueError, match="positive"):
        cspd_log_ratio(x0, means, -variances, means, variances)
    with pytest.raises(ValueError, match="share one shape"):
        cspd_log_ratio(x0, means, variances[:-1], means, variances)


def test_bad_input():
    a = Normal(torch.zeros(4), torch.ones(4))
    b = Normal(torch.zeros(5), torch.ones(5))
    with pytest.raises(ValueError, match="max_tries"):
        verify_continuous(a, a, torch.zeros(4), max_tries=0)
    with pytest.raises(ValueError):
        verify_continuous(a, b, torch.zeros(4))
