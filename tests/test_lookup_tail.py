"""Lookup tails (mmspec.lookup_tail): which tokens a tail copies, and the drafter wrapper's checks.

Losslessness of chains with tails is tested with the other drafters: greedy equality and exact sampled
marginals in tests/test_speculate.py, the image pipeline in tests/test_ar_image_pipeline.py and on the
zoo in tests/test_zoo_t2i.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from mmspec import ModelDrafter, TreeConfig
from mmspec.lookup_tail import LookupTailDrafter, lookup_tail
from mmspec.runner import CausalLMRunner
from mmspec.speculate import DraftChain, Drafter, PrefillContext, RoundResult


def test_tail_copies_the_token_offset_back_and_stops_at_a_change():
    grid = [1, 1, 1,
            1, 1, 2,
            1, 1]  # a 3-wide grid, two tokens of its last row generated
    assert lookup_tail(grid, 4, offset=3) == []  # the next copy (2, above) differs from the token before (1)
    assert lookup_tail(grid, 4, offset=3, stop_at_change=False) == [2, 1, 1, 2]  # copies of copies included
    assert lookup_tail([1, 1, 1, 1, 2, 1], 4, offset=3) == [1]  # then the 2 above differs from the 1 before
    assert lookup_tail([7, 7], 3, offset=5) == [7, 7, 7]  # before a full row: copies of the token before
    assert lookup_tail([7, 8], 3, offset=5) == [8, 8, 8]
    assert lookup_tail([4, 4, 4], 0, offset=2) == []


def _tail_drafter(**kwargs) -> LookupTailDrafter:
    draft = tiny_llama(layers=1, seed=1)
    return LookupTailDrafter(ModelDrafter(draft, 2, **kwargs), 3, offset=2, vocab_size=32)


@pytest.mark.parametrize("bad,match", [(dict(length=0), "length"), (dict(offset=0), "offset"),
                                       (dict(vocab_size=-1), "vocab_size"), (dict(inner="eagle"), "Drafter"),
                                       (dict(lookup_only_from=2), "cannot"), (dict(lookup_only_from=0), "lookup_only")])
def test_bad_arguments_are_clear_errors(bad, match):
    args = dict(inner=ModelDrafter(tiny_llama(layers=1, seed=1), 2), length=3, offset=2, vocab_size=32)
    with pytest.raises(ValueError, match=match):
        LookupTailDrafter(**{**args, **bad})


def test_a_tree_proposal_is_refused():
    target = tiny_llama(layers=1, seed=0)
    drafter = LookupTailDrafter(ModelDrafter(target, tree=TreeConfig(depth=2, top_k=2, total_tokens=4)), 3,
                                offset=2, vocab_size=32)
    runner = CausalLMRunner(target)
    ids = torch.tensor([[3, 5, 7]])
    out = runner.prefill(ids, torch.ones_like(ids))
    drafter.prefill(PrefillContext(ids, torch.ones_like(ids), out, out.logits[:, -1].argmax(-1)))
    with pytest.raises(ValueError, match="extends draft chains"):
        drafter.propose(out.logits[:, -1].argmax(-1))


class _ScriptedDrafter(Drafter):
    """Proposes the same chain every round and records the results it is given."""

    def __init__(self, chain: list[list[int]]) -> None:
        self.chain, self.results = torch.tensor(chain), []

    def prefill(self, context: PrefillContext) -> None:
        self.results.clear()

    def propose(self, pending: torch.Tensor) -> DraftChain:
        return DraftChain(self.chain)

    def commit(self, result: RoundResult) -> None:
        self.results.append(result)


def test_tails_follow_each_rows_committed_tokens():
    """The wrapper keeps every row's generated tokens: the prefill token, then per round the accepted chain
    and tail tokens and the new pending token; each tail reads them (here: copies of the token two back),
    and the inner drafter sees the round's result as it was."""
    inner = _ScriptedDrafter([[5], [6]])
    drafter = LookupTailDrafter(inner, 2, offset=2, vocab_size=32, stop_at_change=False)
    ids = torch.zeros(2, 1, dtype=torch.long)
    drafter.prefill(PrefillContext(ids, torch.ones_like(ids), None, torch.tensor([9, 10])))
    chain = drafter.propose(torch.tensor([9, 10]))
    assert chain.probs is None and chain.tokens.tolist() == [[5, 9, 5], [6, 10, 6]]  # copies of tokens 0, 1
    # row 0 accepts its draft and the first tail token, row 1 nothing; new pending tokens 11 and 12
    result = RoundResult(torch.tensor([[9, 5, 9], [10, -1, -1]]), torch.tensor([2, 0]), torch.tensor([11, 12]))
    drafter.commit(result)
    assert inner.results == [result]
    assert drafter._generated == [[9, 5, 9, 11], [10, 12]]
    assert drafter.propose(torch.tensor([11, 12])).tokens.tolist() == [[5, 11, 5], [6, 12, 6]]


def test_the_round_cap_covers_the_inner_chain_and_the_tail():
    """The loop's ``draft_limit`` (what is left to generate, minus the bonus token) reaches the inner drafter
    and cuts the tail: a round proposes at most that many tokens."""
    inner = _ScriptedDrafter([[5]])
    drafter = LookupTailDrafter(inner, 4, offset=1, vocab_size=32, stop_at_change=False)
    ids = torch.zeros(1, 1, dtype=torch.long)
    drafter.prefill(PrefillContext(ids, torch.ones_like(ids), None, torch.tensor([9])))
    assert drafter.propose(torch.tensor([9])).tokens.shape[1] == 1 + 4  # uncapped: the chain and a 4-token tail
    drafter.draft_limit = 3
    assert drafter.propose(torch.tensor([9])).tokens.tolist() == [[5, 5, 5]]
    assert inner.draft_limit == 3


class _SkippableDrafter(_ScriptedDrafter):
    """A scripted drafter that can also learn rounds it did not draft."""

    can_skip_rounds = True

    def __init__(self, chain: list[list[int]]) -> None:
        super().__init__(chain)
        self.undrafted: list[RoundResult] = []

    def propose(self, pending: torch.Tensor) -> DraftChain:
        self.proposals = getattr(self, "proposals", 0) + 1
        return super().propose(pending)

    def commit_undrafted(self, result: RoundResult) -> None:
        self.undrafted.append(result)


def test_lookup_only_rounds_skip_the_inner_drafter_when_the_tail_is_long():
    inner = _SkippableDrafter([[5]])
    drafter = LookupTailDrafter(inner, 4, offset=2, vocab_size=32, lookup_only_from=3)
    ids = torch.zeros(1, 1, dtype=torch.long)
    drafter.prefill(PrefillContext(ids, torch.ones_like(ids), None, torch.tensor([9])))
    chain = drafter.propose(torch.tensor([9]))  # one token: a tail of copies of it, long enough to skip
    assert chain.tokens.tolist() == [[9, 9, 9, 9]] and chain.probs is None and not hasattr(inner, "proposals")
    result = RoundResult(torch.tensor([[9, 9]]), torch.tensor([1]), torch.tensor([4]))
    drafter.commit(result)
    assert inner.undrafted == [result] and inner.results == []
    assert drafter._generated == [[9, 9, 4]]
    chain = drafter.propose(torch.tensor([4]))  # 9 above 4 differs: no tail before drafting, the inner drafts
    assert inner.proposals == 1 and chain.tokens[0, 0].item() == 5
    drafter.commit(RoundResult(torch.tensor([[4]]), torch.tensor([0]), torch.tensor([7])))
    assert len(inner.results) == 1 and len(inner.undrafted) == 1


def test_tails_stop_at_the_last_position_a_row_generates():
    """``max_length`` (an image's token count): no tail position reaches past it, in drafted and lookup-only
    rounds alike."""
    inner = _SkippableDrafter([[5]])
    drafter = LookupTailDrafter(inner, 10, offset=2, vocab_size=32, stop_at_change=False, max_length=4)
    ids = torch.zeros(1, 1, dtype=torch.long)
    drafter.prefill(PrefillContext(ids, torch.ones_like(ids), None, torch.tensor([9])))
    assert drafter.propose(torch.tensor([9])).tokens.tolist() == [[5, 9, 5]]  # positions 1, 2, 3 of 0..3
    skipping = LookupTailDrafter(_SkippableDrafter([[5]]), 10, offset=2, vocab_size=32, lookup_only_from=2,
                                 max_length=3)
    skipping.prefill(PrefillContext(ids, torch.ones_like(ids), None, torch.tensor([9])))
    assert skipping.propose(torch.tensor([9])).tokens.tolist() == [[9, 9]]  # lookup-only, positions 1 and 2
    with pytest.raises(ValueError, match="max_length"):
        LookupTailDrafter(_SkippableDrafter([[5]]), 10, offset=2, vocab_size=32, max_length=0)
