"""Speculative coupled decoding (SCD): the coupled redraw keeps the target distribution exactly and keeps the
previous token as often as a coupling can; in the Jacobi loop more slots keep their token between rounds."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from stats_utils import P_VALUE_FLOOR, chi_square_pvalue, empirical

from mmspec.drafters import JacobiDrafter
from mmspec.runner import CausalLMRunner
from mmspec.sampling import SamplingConfig, coupled_redraw
from mmspec.speculate import speculative_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("vocab", [2, 7, 64])
def test_coupled_redraw_draws_from_the_new_distribution_and_keeps_one_minus_tv(vocab):
    """10^5 draws per distribution pair: the redraw follows p (chi-square p >= 1e-4) whatever q the previous
    tokens came from, and keeps the previous token with probability 1 - TV(p, q) (within 4 standard errors)."""
    generator = torch.Generator().manual_seed(vocab)
    q = torch.rand(vocab, generator=generator, dtype=torch.float64) ** 3
    p = torch.rand(vocab, generator=generator, dtype=torch.float64) ** 3
    q, p = q / q.sum(), p / p.sum()
    rows = 100_000
    previous = torch.multinomial(q, rows, replacement=True, generator=generator)
    redrawn = coupled_redraw(previous, q.expand(rows, -1), p.expand(rows, -1), generator)
    assert chi_square_pvalue(empirical(redrawn, vocab), p) >= P_VALUE_FLOOR
    kept = float((redrawn == previous).double().mean())
    expected = 1.0 - 0.5 * float((p - q).abs().sum())
    assert abs(kept - expected) < 4 * (expected * (1 - expected) / rows) ** 0.5 + 1e-9


def test_coupled_redraw_of_equal_distributions_keeps_every_token_and_refuses_nan_rows():
    probs = torch.tensor([[0.2, 0.5, 0.3]]).expand(1000, -1)
    previous = torch.multinomial(probs[0], 1000, replacement=True)
    assert torch.equal(coupled_redraw(previous, probs, probs), previous)
    bad = probs.clone()
    bad[3] = float("nan")
    with pytest.raises(ValueError, match=r"target distribution: row \[3\] contains NaN"):
        coupled_redraw(previous, probs, bad, name="target distribution")


def _jacobi_run(coupled: bool, rows: int = 3000, greedy: bool = False, max_new_tokens: int = 8, seed: int = 1):
    vocab = 12
    target = tiny_llama(vocab_size=vocab, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.5)
    prompt = torch.tensor([3, 5, 7, 9]).expand(rows, -1).contiguous()
    sampling = SamplingConfig(do_sample=not greedy)
    drafter = JacobiDrafter(vocab, window=4, sampling=sampling, generator=torch.Generator().manual_seed(seed),
                            coupled=coupled)
    return speculative_generate(CausalLMRunner(target), drafter, prompt, max_new_tokens=max_new_tokens,
                                sampling=sampling, generator=torch.Generator().manual_seed(seed + 1))


def test_coupled_jacobi_redraws_keep_more_tokens_between_rounds_than_independent_ones(monkeypatch):
    """The mechanism, in the loop: the share of window slots whose token survives a round unchanged is higher
    with coupled redraws (the marginals stay exact: tests/test_speculate.py, tests/test_ar_image_pipeline.py)."""
    kept = {}
    original = JacobiDrafter.commit

    def counting_commit(self, result):
        before, emitted = self._tokens.clone(), result.num_accepted + 1
        original(self, result)
        after = self._tokens
        width = min(after.shape[1], before.shape[1] - int(emitted.max()))
        if width <= 0:
            return
        shifted = torch.stack([before[row, int(e):int(e) + width] for row, e in enumerate(emitted)])
        same, total = kept.get(self.coupled, (0, 0))
        kept[self.coupled] = (same + int((after[:, :width] == shifted).sum()), total + shifted.numel())

    monkeypatch.setattr(JacobiDrafter, "commit", counting_commit)
    for seed in range(10):  # one row at a time: a batch keeps only the slots every row kept
        _jacobi_run(False, rows=1, max_new_tokens=48, seed=seed), _jacobi_run(True, rows=1, max_new_tokens=48, seed=seed)
    rate = {coupled: same / total for coupled, (same, total) in kept.items()}
    assert rate[True] > rate[False] + 0.05


def test_greedy_coupled_jacobi_is_greedy_jacobi():
    assert torch.equal(_jacobi_run(True, rows=4, greedy=True).sequences, _jacobi_run(False, rows=4, greedy=True).sequences)
