"""Statistical helpers for losslessness tests (stated tolerances, fixed seeds, so never flaky)."""

from __future__ import annotations

import torch
from scipy import stats as scipy_stats

# A test fails when the chi-square goodness-of-fit p-value falls below this. Seeds are fixed, so a pass
# is reproducible; a broken sampler gives p-values that are astronomically small, not 1e-4.
P_VALUE_FLOOR = 1e-4


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.flatten(), minlength=vocab).double()


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of ``counts [V]`` to ``probs [V]``; bins with expected count < 5 are pooled."""
    total = counts.sum()
    expected = probs.double() * total
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().reshape(1)])
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
        if expected[-1] == 0:
            assert counts[-1] == 0, "tokens sampled where the target has no mass"
            counts, expected = counts[:-1], expected[:-1]
    return float(scipy_stats.chisquare(counts.numpy(), expected.numpy() * counts.sum().item() / expected.sum().item()).pvalue)


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs.double()).abs().sum())


def make_dist(batch: int, steps: int, vocab: int, peaked: bool, generator: torch.Generator) -> torch.Tensor:
    """Random distributions ``[batch, steps, vocab]``: peaked (low entropy) or flat."""
    scale = 4.0 if peaked else 0.5
    logits = torch.randn(batch, steps, vocab, generator=generator, dtype=torch.float64) * scale
    return logits.softmax(-1)


def two_sample_chi2_pvalue(a, b) -> float:
    """p-value of a chi-square homogeneity test that two samples of token ids come from one distribution
    (categories seen fewer than 5 times in total are pooled, so the test's approximation holds)."""
    import numpy as np
    from scipy.stats import chi2_contingency

    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    values = np.union1d(a, b)
    table = np.stack([(a[:, None] == values).sum(0), (b[:, None] == values).sum(0)])
    rare = table.sum(0) < 5
    if rare.any():
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], 1)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(table)[1])
