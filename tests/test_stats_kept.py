"""SpecStats counts only the tokens a run kept, and draft chains are capped by what is left to generate.

A verification's tokens past a row's EOS or ``max_new_tokens`` are thrown away; the statistics must not
count them, so on every run ``emitted`` is the tokens the rows gained from verifications (all but each
row's prefill token) and ``mean_accepted_length`` is the kept tokens per (row, target verification).
The runs end mid-chain on purpose: a drafter that agrees with the target drafts long chains.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from mmspec import (
    CausalLMRunner,
    JacobiDrafter,
    ModelDrafter,
    SamplingConfig,
    TreeConfig,
    speculative_generate,
)
from mmspec.models.eagle import EagleDrafter, EagleHead

MAX_NEW = 24


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=2, seed=0)


@pytest.fixture(scope="module")
def small_drafter_model():
    return tiny_llama(layers=1, seed=1)


def _prompt(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 32, (batch, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1:, :2] = 0  # left padding in the later rows
    return ids, mask


@pytest.fixture(scope="module")
def baselines(target):
    """Target-only runs (and their rounds) by ``(batch, eos_token_id)``, each run once."""
    runs: dict[tuple[int, int | None], tuple] = {}

    def get(batch: int, eos_token_id: int | None = None):
        if (batch, eos_token_id) not in runs:
            runs[batch, eos_token_id] = _generate(target, None, batch=batch, eos_token_id=eos_token_id)
        return runs[batch, eos_token_id]
    return get


def _eagle_head(target) -> EagleHead:
    torch.manual_seed(0)
    head = EagleHead(hidden_size=target.config.hidden_size, vocab_size=target.config.vocab_size,
                     num_attention_heads=4).to(torch.float64)
    return head.bind_target(target.get_input_embeddings(), target.get_output_embeddings())


def _generate(target, drafter, batch: int = 1, **kwargs):
    """A run and what its streaming callback saw: per round after the prefill, the tokens each row kept."""
    ids, mask = _prompt(batch)
    rounds: list[list[int]] = []

    def record(tokens: torch.Tensor, _drafted: torch.Tensor) -> None:
        rounds.append((tokens >= 0).sum(1).tolist())

    runner = CausalLMRunner(target, return_hidden=isinstance(drafter, EagleDrafter))
    out = speculative_generate(runner, drafter, ids, mask, max_new_tokens=kwargs.pop("max_new_tokens", MAX_NEW),
                               callback=record, **kwargs)
    return out, rounds[1:]  # the first callback is the prefill's token


def _assert_counts_kept_tokens(out, rounds: list[list[int]]) -> None:
    """Every statistic counts exactly what the output kept (per row, summed over rows)."""
    stats, batch = out.stats, out.sequences.shape[0]
    assert stats.tokens == int(out.lengths.sum())
    assert stats.emitted + batch == stats.tokens  # each row's prefill token is its only one not from a verification
    assert stats.verify_steps == sum(kept > 0 for row in rounds for kept in row)
    assert stats.emitted == sum(sum(row) for row in rounds)
    assert stats.target_calls == 1 + len(rounds)
    assert stats.mean_accepted_length == pytest.approx(stats.emitted / stats.verify_steps)
    accepted = sum(stats.position_accepts)
    assert accepted == int(out.drafted.sum())  # an accepted draft counts iff the output kept it
    assert all(a <= n for a, n in zip(stats.position_accepts, stats.position_attempts))


@pytest.mark.parametrize("num_draft_tokens,target_calls", [(6, 5), (64, 2)])
def test_one_row_ending_mid_chain_counts_tokens_per_target_call(target, num_draft_tokens, target_calls):
    """K=6: 23 tokens after the prefill's come from 4 verifications (7, 7, 7 and 2), not 4 x 7; K=64: one
    verification of 23 tokens, not 65."""
    out, rounds = _generate(target, ModelDrafter(target, num_draft_tokens))
    stats = out.stats
    assert stats.tokens == MAX_NEW and stats.target_calls == target_calls
    assert stats.emitted + 1 == stats.tokens
    assert stats.mean_accepted_length == (stats.tokens - 1) / (stats.target_calls - 1)
    assert stats.mean_accepted_drafts == stats.mean_accepted_length - 1
    assert len(stats.position_attempts) <= MAX_NEW - 1  # no draft position past the last token
    _assert_counts_kept_tokens(out, rounds)


def _token_ending_mid_chain(sequence: list[int], chain: int) -> int:
    """A token of ``sequence`` (target-only greedy output) whose first occurrence is inside a round of a
    perfect ``chain``-token drafter (not its round's last token): as EOS it ends the run mid-chain."""
    for i in range(2, len(sequence) - 1):
        if sequence[i] not in sequence[:i] and (i - 1) % (chain + 1) != chain:
            return sequence[i]
    raise AssertionError(f"no token of {sequence} first occurs inside a chain")


@pytest.mark.parametrize("tree", [None, TreeConfig(depth=6, top_k=2, total_tokens=12)], ids=["chain", "tree"])
def test_one_row_ending_at_eos_mid_chain_counts_tokens_per_target_call(target, baselines, tree):
    eos = _token_ending_mid_chain(baselines(1)[0].sequences[0].tolist(), 6)
    out, rounds = _generate(target, ModelDrafter(target, 6, tree=tree), eos_token_id=eos)
    reference, _ = baselines(1, eos)
    assert torch.equal(out.sequences, reference.sequences) and out.stats.tokens < MAX_NEW
    stats = out.stats
    assert stats.emitted + 1 == stats.tokens
    assert stats.mean_accepted_length == (stats.tokens - 1) / (stats.target_calls - 1)
    _assert_counts_kept_tokens(out, rounds)


BATCH_DRAFTERS = {
    "chain-self": lambda t, d: ModelDrafter(t, 6),
    "chain-small": lambda t, d: ModelDrafter(d, 3),
    "tree-self": lambda t, d: ModelDrafter(t, tree=TreeConfig(depth=8, top_k=2, total_tokens=16)),
    "jacobi": lambda t, d: JacobiDrafter(32, window=6),
    "eagle": lambda t, d: EagleDrafter(_eagle_head(t), 5),
}


@pytest.mark.parametrize("name", list(BATCH_DRAFTERS))
@pytest.mark.parametrize("eos", [False, True], ids=["length", "eos"])
def test_batched_runs_count_only_kept_tokens_per_row(target, small_drafter_model, baselines, name, eos):
    """Rows end at different rounds (EOS) and mid-chain (length): every counter sums over rows what each kept."""
    eos_id = _token_ending_mid_chain(baselines(3)[0].sequences[1].tolist(), 6) if eos else None
    baseline, baseline_rounds = baselines(3, eos_id)
    out, rounds = _generate(target, BATCH_DRAFTERS[name](target, small_drafter_model), batch=3, eos_token_id=eos_id)
    assert torch.equal(out.sequences, baseline.sequences)
    _assert_counts_kept_tokens(out, rounds)
    _assert_counts_kept_tokens(baseline, baseline_rounds)
    assert baseline.stats.mean_accepted_length == 1.0


def test_sampled_runs_count_only_kept_tokens(target):
    sampling = SamplingConfig(do_sample=True)
    drafter = ModelDrafter(target, 8, sampling=sampling, generator=torch.Generator().manual_seed(1))
    out, rounds = _generate(target, drafter, batch=3, sampling=sampling, generator=torch.Generator().manual_seed(0))
    _assert_counts_kept_tokens(out, rounds)


@pytest.mark.parametrize("make", [
    lambda t, k: ModelDrafter(t, k),
    lambda t, k: ModelDrafter(t, tree=TreeConfig(depth=k, top_k=2, total_tokens=16)),
    lambda t, k: EagleDrafter(_eagle_head(t), k),
], ids=["chain", "tree", "eagle"])
def test_absurd_chain_lengths_are_capped_by_what_is_left(target, baselines, make):
    """K=10**6 drafts at most what is left minus one per round: the same rounds, drafter forwards and greedy
    output as K=24 (also capped there), so it takes the time of a short run (uncapped, it took minutes)."""
    huge, _ = _generate(target, make(target, 10**6), batch=2)
    fitting, _ = _generate(target, make(target, MAX_NEW), batch=2)
    baseline, _ = baselines(2)
    assert torch.equal(huge.sequences, baseline.sequences) and torch.equal(huge.sequences, fitting.sequences)
    assert (huge.stats.target_calls, huge.stats.draft_calls) == (fitting.stats.target_calls, fitting.stats.draft_calls)
    assert len(huge.stats.position_attempts) <= MAX_NEW - 1


def test_a_round_that_can_keep_one_token_drafts_nothing(target):
    """With one token left in every row the round is a target-only forward: K drafts would all be discarded."""
    drafter = ModelDrafter(target, 4)
    out, rounds = _generate(target, drafter, max_new_tokens=6)  # prefill 1, then 5 = 4 drafts + the bonus
    assert rounds == [[5]] and out.stats.draft_calls == 1 + 4  # the drafter's prefill, then 4 draft forwards
    out, rounds = _generate(target, ModelDrafter(target, 4), max_new_tokens=7)  # ... then one token left
    assert rounds == [[5], [1]] and out.stats.draft_calls == 1 + 4 and out.stats.target_calls == 3
    assert drafter.draft_limit is None  # reset after the run


def test_a_kept_draft_from_the_head_s_prefill_counts_its_forward(target):
    """An EAGLE head drafts the first round from its prefill forward: with one draft left (max_new_tokens=2)
    that round runs no other head forward, and a kept draft must still show the forward it came from."""
    out, rounds = _generate(target, EagleDrafter(_eagle_head(target), 4), max_new_tokens=2)
    assert out.stats.draft_calls == 1  # the prefill forward, whatever the round kept
    assert not out.drafted.any() or out.stats.draft_calls >= 1
