"""SJD-PAC (``method="sjd_pac"``) and the SCD refill: lossless by exact enumeration of a tiny target's law, greedy
output equal to target-only decoding, batch rows independent, the tree layout and config errors."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from stats_utils import P_VALUE_FLOOR, chi_square_pvalue, empirical

from mmspec import CausalLMRunner, SamplingConfig, speculative_generate
from mmspec.drafters import JacobiDrafter
from mmspec.methods import get
from mmspec.methods.sjd_pac import SJDPACConfig, SJDPACDrafter, tree_layout
from mmspec.speculate import DraftChain
from mmspec.tree import DraftTree

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, LENGTH = 6, 4


def exact_joint(target, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """The target's exact law of its first ``steps`` sampled tokens after ``prompt [T]``, enumerated over every
    prefix: ``[V ** steps]`` indexed by the sequence read as a base-V number (first token most significant)."""
    vocab = target.config.vocab_size
    prefixes, weights = prompt.unsqueeze(0), torch.ones(1, dtype=torch.float64)
    for _ in range(steps):
        with torch.no_grad():
            probs = target(prefixes).logits[:, -1].double().softmax(-1)  # [P, V]
        weights = (weights.unsqueeze(1) * probs).flatten()
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0),
                              torch.arange(vocab).repeat(len(prefixes)).unsqueeze(1)], 1)
    return weights


def sequence_ids(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[R, L]`` token rows as base-``vocab`` numbers (the index of :func:`exact_joint`)."""
    powers = vocab ** torch.arange(tokens.shape[1] - 1, -1, -1)
    return (tokens * powers).sum(1)


def _softened_target():
    target = tiny_llama(vocab_size=VOCAB, layers=2, seed=3)
    with torch.no_grad():  # soften so that drafts are both accepted and rejected
        target.lm_head.weight.mul_(0.3)
    return target


def _count_trees(drafter):
    """Wrap ``drafter.propose`` to count the tree proposals it returns."""
    counts = {"tree": 0, "chain": 0}
    propose = drafter.propose

    def counting(pending):
        proposal = propose(pending)
        counts["tree" if isinstance(proposal, DraftTree) else "chain"] += 1
        return proposal

    drafter.propose = counting
    return counts


SETTINGS = {
    "both": {},
    "proactive_only": {"adaptive_continuation": False},
    "continuation_only": {"proactive": False},
    "neither": {"proactive": False, "adaptive_continuation": False},
    "wide_shallow": {"tree_width": 4, "tree_depth": 2},
    "fresh_one_hot": {"fresh_q": "one_hot"},
    "left_init": {"init": "left"},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sjd_pac_samples_the_targets_exact_law(name):
    """20000 rows of two prompts (alternating, one batch): each prompt's rows follow the target's exact law of
    its first four tokens, the joint over all 6^4 sequences (chi-square p >= 1e-4), with every part on or off."""
    target = _softened_target()
    prompts = torch.tensor([[3, 5, 1, 2], [4, 0, 2, 5]])
    rows = 20_000
    ids = prompts.repeat(rows // 2, 1)
    sampling = SamplingConfig(do_sample=True)
    options = {"tree_width": 3, "tree_depth": 3, **SETTINGS[name]}
    init = options.pop("init", "random")
    drafter = SJDPACDrafter(VOCAB, window=3, sampling=sampling, init=init,
                            generator=torch.Generator().manual_seed(1), **options)
    counts = _count_trees(drafter)
    out = speculative_generate(CausalLMRunner(target), drafter, ids, max_new_tokens=LENGTH, sampling=sampling,
                               generator=torch.Generator().manual_seed(2))
    assert 1.05 < out.stats.mean_accepted_length < 4.0  # drafts are accepted and rejected
    assert (counts["tree"] > 0) == (drafter.levels > 0)
    for p, prompt in enumerate(prompts):
        law = exact_joint(target, prompt, LENGTH)
        seen = empirical(sequence_ids(out.sequences[p::2], VOCAB), VOCAB ** LENGTH)
        assert chi_square_pvalue(seen, law) >= P_VALUE_FLOOR, f"prompt {p}"


@pytest.mark.parametrize("keep_last_draw,fresh_q,coupling", [(True, "uniform", "maximal"), (False, "uniform", "maximal"),
                                                              (True, "one_hot", "maximal"), (False, "one_hot", "maximal"),
                                                              (True, "uniform", "gumbel"), (False, "one_hot", "gumbel")])
def test_scd_refill_choices_sample_the_targets_exact_law(keep_last_draw, fresh_q, coupling):
    """SCD with the target's draw after the last draft kept (the release's refill) or discarded, fresh slots
    with a uniform or a one-hot q, maximal or Gumbel coupling: the joint of the first four tokens is the
    target's exactly."""
    target = _softened_target()
    prompt = torch.tensor([3, 5, 1, 2])
    sampling = SamplingConfig(do_sample=True)
    drafter = JacobiDrafter(VOCAB, window=2, sampling=sampling, generator=torch.Generator().manual_seed(1),
                            coupled=True, keep_last_draw=keep_last_draw, fresh_q=fresh_q, coupling=coupling)
    out = speculative_generate(CausalLMRunner(target), drafter, prompt.expand(20_000, -1).contiguous(),
                               max_new_tokens=LENGTH, sampling=sampling, generator=torch.Generator().manual_seed(2))
    assert 1.05 < out.stats.mean_accepted_length
    seen = empirical(sequence_ids(out.sequences, VOCAB), VOCAB ** LENGTH)
    assert chi_square_pvalue(seen, exact_joint(target, prompt, LENGTH)) >= P_VALUE_FLOOR


@pytest.mark.parametrize("name", ["both", "proactive_only", "neither"])
def test_greedy_sjd_pac_equals_target_only_decoding(name):
    target = tiny_llama(vocab_size=32, layers=2, seed=0)
    ids = torch.randint(3, 32, (3, 7), generator=torch.Generator().manual_seed(0))
    greedy = SamplingConfig(do_sample=False)
    baseline = speculative_generate(CausalLMRunner(target), None, ids, max_new_tokens=40)
    drafter = SJDPACDrafter(32, window=6, sampling=greedy, **SETTINGS[name])
    counts = _count_trees(drafter)
    out = speculative_generate(CausalLMRunner(target), drafter, ids, max_new_tokens=40)
    assert torch.equal(out.sequences, baseline.sequences)
    assert (counts["tree"] > 0) == (name != "neither")
    if counts["tree"]:  # the top-3 siblings of the cached distributions find the new argmax often enough
        assert out.stats.target_calls < baseline.stats.target_calls


def test_batch_rows_decode_as_they_would_alone_when_greedy():
    """Greedy rows of a batch give what each gives alone (rows keep different numbers of columns per round)."""
    target = tiny_llama(vocab_size=32, layers=2, seed=0)
    ids = torch.randint(3, 32, (3, 7), generator=torch.Generator().manual_seed(4))
    greedy = SamplingConfig(do_sample=False)
    batch = speculative_generate(CausalLMRunner(target), SJDPACDrafter(32, window=5, sampling=greedy), ids,
                                 max_new_tokens=30)
    for row in range(3):
        alone = speculative_generate(CausalLMRunner(target), SJDPACDrafter(32, window=5, sampling=greedy),
                                     ids[row:row + 1], max_new_tokens=30)
        assert torch.equal(batch.sequences[row], alone.sequences[0])


def test_tree_layout_is_a_full_k_ary_tree_then_one_chain():
    parents, columns, ranks = tree_layout(4, 2, 3)
    assert parents == (-1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 12)
    assert columns == (0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 3)
    assert ranks == (0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 0)
    assert tree_layout(3, 0, 4) == ((-1, 0, 1), (0, 1, 2), (0, 0, 0))


def test_a_rejection_drafts_a_tree_of_distinct_siblings_from_the_cached_distributions():
    """After a round with a rejection the next proposal is a tree whose sibling groups hold distinct tokens and
    carry the column's cached distribution; after a chain proposal (no cached columns) it is a chain."""
    vocab = 10
    sampling = SamplingConfig(do_sample=True)
    drafter = SJDPACDrafter(vocab, window=4, sampling=sampling, generator=torch.Generator().manual_seed(0),
                            tree_width=3, tree_depth=3)
    target = tiny_llama(vocab_size=vocab, layers=1, seed=1)
    seen = []
    propose = drafter.propose
    drafter.propose = lambda pending: seen.append(propose(pending)) or seen[-1]
    speculative_generate(CausalLMRunner(target), drafter, torch.tensor([[1, 2, 3]]), max_new_tokens=30,
                         sampling=sampling, generator=torch.Generator().manual_seed(1))
    assert isinstance(seen[0], DraftChain)
    trees = [p for p in seen if isinstance(p, DraftTree)]
    assert trees and all(t.without_replacement for t in trees)
    for tree in trees:
        if tree.num_nodes < 3 + 9:  # cut by the length limit
            continue
        assert len(set(tree.tokens[0, :3].tolist())) == 3  # the root's three children are distinct
        assert torch.equal(tree.draft_probs[0, 0], tree.draft_probs[0, 2])
        assert torch.equal(tree.tokens[0, 3:6], tree.tokens[0, 6:9])  # every level-1 node has the same children


def test_config_is_registered_and_refuses_bad_values():
    assert get("sjd_pac", "ar_image") is SJDPACConfig
    config = SJDPACConfig()
    assert (config.tree_width, config.tree_depth, config.proactive, config.adaptive_continuation) == (4, 3, True, True)
    for field, value in [("tree_width", 0), ("tree_depth", 0), ("proactive", 1), ("adaptive_continuation", "no"),
                         ("fresh_q", "zero")]:
        with pytest.raises(ValueError, match=f"SJDPACConfig.{field}"):
            config.replace(**{field: value})
    with pytest.raises(ValueError, match="tree_width=5 exceeds the 4 tokens"):
        SJDPACDrafter(4, sampling=SamplingConfig(), tree_width=5)
