"""Draft trees: masks, construction, and lossless verification."""

from __future__ import annotations

import pytest
import torch
from stats_utils import P_VALUE_FLOOR, chi_square_pvalue, empirical, make_dist
from test_verify import MarkovWorld

from mmspec import (
    DraftTree,
    ExactRule,
    GreedyRule,
    LanternRule,
    static_tree_from_choices,
    tree_attention_mask,
    verify_tree,
)
from mmspec.sampling import sample
from mmspec.tree import (
    TreeAttentionBuilder,
    children_table,
    expand_dynamic_tree,
    tree_depths,
    tree_position_offsets,
)

CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [1, 0, 0]]


def test_static_tree_layout_and_masks():
    parents, ranks = static_tree_from_choices(CHOICES)
    assert parents.tolist() == [-1, -1, -1, 0, 0, 1, 3, 3, 5]
    assert ranks.tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 0]
    batch_parents = parents.expand(2, -1)
    assert tree_depths(batch_parents)[0].tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert tree_position_offsets(batch_parents)[0].tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    mask = tree_attention_mask(batch_parents)
    assert mask.shape == (2, 10, 10)
    assert mask[0, 0].tolist() == [True] + [False] * 9  # root sees itself only
    # node 6 (input index 7) sees root, node 0, node 3, itself
    assert mask[0, 7].nonzero().flatten().tolist() == [0, 1, 4, 7]
    table = children_table(batch_parents)
    assert table[0, 0].tolist() == [0, 1, 2] and table[0, 1].tolist() == [3, 4, -1]
    with pytest.raises(ValueError, match="not its parent"):
        static_tree_from_choices([[0, 1]])


def _ancestors(parents: list[int], node: int) -> list[int]:
    """Plain-Python reference: the node and every ancestor, walking parent pointers."""
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out


@pytest.mark.parametrize("seed", range(5))
def test_depths_and_masks_match_a_walk_up_the_parents(seed):
    """The vectorised pointer-jumping depths and the level-by-level masks equal a per-node walk on
    random trees of up to 40 nodes (wide, deep, several rows with different shapes)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        rows, nodes = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 41, (1,), generator=g))
        parents = torch.tensor([[-1] + [int(torch.randint(-1, j, (1,), generator=g)) for j in range(1, nodes)]
                                for _ in range(rows)])
        depths, mask = tree_depths(parents), tree_attention_mask(parents, include_root=False)
        for b in range(rows):
            row = parents[b].tolist()
            for j in range(nodes):
                chain = _ancestors(row, j)
                assert depths[b, j] == len(chain)
                assert mask[b, j].nonzero().flatten().tolist() == sorted(chain)
    chain = torch.arange(-1, 39).unsqueeze(0)  # one path of depth 40
    assert tree_depths(chain)[0].tolist() == list(range(1, 41))
    assert torch.equal(tree_attention_mask(chain, include_root=False)[0], torch.ones(40, 40, dtype=torch.bool).tril())


def run_tree(world: MarkovWorld, rows: int, rule, stochastic: bool, seed: int) -> torch.Tensor:
    """Generate ``world.length`` tokens per row with static-tree rounds; returns ``[rows, length]``."""
    g = torch.Generator().manual_seed(seed)
    parents, ranks = static_tree_from_choices(CHOICES)
    depths = tree_depths(parents.unsqueeze(0))[0]
    vocab, length, max_depth = world.vocab, world.length, int(depths.max())
    out = torch.full((rows, length + max_depth + 1), -1, dtype=torch.long)
    pos = torch.zeros(rows, dtype=torch.long)
    prev = torch.full((rows,), vocab, dtype=torch.long)
    while (pos < length).any():
        pos = pos.clamp(max=length)
        tokens, qs, ps = [], [], [world.target[pos, prev]]
        for node in range(len(CHOICES)):
            parent = int(parents[node])
            state = prev if parent < 0 else tokens[parent]
            q = world.draft[pos + int(depths[node]) - 1, state]
            token = sample(q, g) if stochastic else q.argsort(-1, descending=True)[:, int(ranks[node])]
            tokens.append(token)
            qs.append(q)
            ps.append(world.target[pos + int(depths[node]), token])
        tree = DraftTree(torch.stack(tokens, 1), parents.expand(rows, -1), torch.stack(qs, 1) if stochastic else None)
        result = verify_tree(tree, torch.stack(ps, 1), rule, g)
        emitted = result.num_accepted + 1
        width = result.tokens.shape[1]
        idx = pos.unsqueeze(1) + torch.arange(width)
        keep = torch.arange(width) < emitted.unsqueeze(1)
        out.scatter_(1, torch.where(keep, idx, out.shape[1] - 1), torch.where(keep, result.tokens, -1))
        prev = result.tokens.gather(1, result.num_accepted.unsqueeze(1)).squeeze(1)
        pos = pos + emitted
    return out[:, :length]


@pytest.mark.parametrize("stochastic", [False, True], ids=["topk_siblings", "sampled_siblings"])
@pytest.mark.parametrize("vocab,peaked", [(6, False), pytest.param(10, True, marks=pytest.mark.slow)])
def test_verify_tree_is_lossless(vocab, peaked, stochastic):
    """10^5 rows; every position's marginal and the joint of positions 0-1 match the target."""
    world = MarkovWorld(vocab, length=4, num_draft=4, peaked=peaked, seed=vocab)
    tokens = run_tree(world, rows=100_000, rule=ExactRule(), stochastic=stochastic, seed=5)
    for j, marginal in enumerate(world.marginals()):
        assert chi_square_pvalue(empirical(tokens[:, j], vocab), marginal) > P_VALUE_FLOOR, f"position {j}"
    pair = tokens[:, 0] * vocab + tokens[:, 1]
    assert chi_square_pvalue(empirical(pair, vocab * vocab), world.pair_joint()) > P_VALUE_FLOOR


def test_tree_greedy_follows_argmax_path():
    g = torch.Generator().manual_seed(0)
    parents, _ = static_tree_from_choices(CHOICES)
    probs = make_dist(3, len(CHOICES) + 1, 12, peaked=True, generator=g)
    argmax = probs.argmax(-1)  # [3, N+1]
    tokens = torch.randint(0, 12, (3, len(CHOICES)), generator=g)
    # row 0: node 1 (second root child) is the root argmax, its child node 5 the argmax after node 1
    tokens[0, 0], tokens[0, 1] = (argmax[0, 0] + 1) % 12, argmax[0, 0]
    tokens[0, 5] = argmax[0, 2]
    tokens[0, 8] = (argmax[0, 6] + 1) % 12
    result = verify_tree(DraftTree(tokens, parents.expand(3, -1)), probs, GreedyRule())
    assert result.num_accepted[0] == 2 and result.path[0, :2].tolist() == [1, 5]
    assert result.tokens[0, :3].tolist() == [argmax[0, 0], argmax[0, 2], argmax[0, 6]]


def test_relaxed_rule_accepts_more_in_trees():
    world = MarkovWorld(8, length=4, num_draft=4, peaked=False, seed=3)
    codebook = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    dist = torch.cdist(codebook, codebook).fill_diagonal_(float("inf"))
    neighbors = dist.argsort(-1)[:, :3]
    g = torch.Generator().manual_seed(0)
    parents, ranks = static_tree_from_choices(CHOICES)
    rows = 4000
    prev = torch.full((rows,), 8)
    accepted = {}
    for name, rule in (("exact", ExactRule()), ("lantern", LanternRule(neighbors, k=3, delta=0.3))):
        tokens, ps = [], [world.target[0, prev]]
        depths = tree_depths(parents.unsqueeze(0))[0]
        for node in range(len(CHOICES)):
            state = prev if parents[node] < 0 else tokens[int(parents[node])]
            token = world.draft[int(depths[node]) - 1, state].argsort(-1, descending=True)[:, int(ranks[node])]
            tokens.append(token)
            ps.append(world.target[int(depths[node]), token])
        tree = DraftTree(torch.stack(tokens, 1), parents.expand(rows, -1))
        accepted[name] = verify_tree(tree, torch.stack(ps, 1), rule, g).num_accepted.float().mean()
    assert accepted["lantern"] > accepted["exact"] + 0.1


def test_dynamic_tree_expansion():
    """EAGLE-2 expansion with a context-free step function: structure and ancestor closure."""
    vocab, batch = 20, 2
    g = torch.Generator().manual_seed(0)
    table = make_dist(1, vocab, vocab, peaked=True, generator=g)[0].log()  # next-token log-probs by last token
    root = table[torch.tensor([3, 7])]
    calls = []

    def step(tokens, node_ids, parent_ids, depth):
        calls.append((tokens.shape, depth))
        return table[tokens]

    tree = expand_dynamic_tree(root, step, depth=4, top_k=3, total_tokens=10)
    assert tree.tokens.shape == (batch, 10) and tree.draft_probs is None
    assert [c[1] for c in calls] == [1, 2, 3] and all(c[0] == (batch, 3) for c in calls)
    # topological order and parent tokens consistent with scores: children never outscore parents
    depths = tree.depths()
    assert (depths[:, 1:] >= depths[:, :-1]).all()
    assert ((tree.parents < torch.arange(10)) | (tree.parents == -1)).all()
    # the best root child is the first node
    assert torch.equal(tree.tokens[:, 0], root.argmax(-1))


def test_tree_attention_builder_tracks_ancestors():
    builder = TreeAttentionBuilder(batch=1)
    first = builder.feed(torch.tensor([[0, 1]]), torch.tensor([[-1, -1]]))
    assert first.tolist() == [[[True, False], [False, True]]]
    second = builder.feed(torch.tensor([[5, 6]]), torch.tensor([[1, 0]]))
    # node 5 (parent 1) sees slot 1 and itself (slot 2); node 6 (parent 0) sees slot 0 and slot 3
    assert second.tolist() == [[[False, True, True, False], [True, False, False, True]]]
    with pytest.raises(ValueError, match="never fed"):
        builder.feed(torch.tensor([[9]]), torch.tensor([[42]]))


def test_tree_bad_input():
    parents, _ = static_tree_from_choices(CHOICES)
    tokens = torch.zeros(1, len(CHOICES), dtype=torch.long)
    probs = torch.full((1, len(CHOICES) + 1, 5), 0.2, dtype=torch.float64)
    with pytest.raises(ValueError, match="topologically"):
        DraftTree(tokens, torch.full_like(tokens, 3))
    with pytest.raises(ValueError, match=r"\[B, N\+1, V\]"):
        verify_tree(DraftTree(tokens, parents.unsqueeze(0)), probs[:, :-1])
    with pytest.raises(ValueError, match="outside"):
        verify_tree(DraftTree(tokens + 7, parents.unsqueeze(0)), probs)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_tree(DraftTree(tokens, parents.unsqueeze(0), torch.ones(1, len(CHOICES), 4)), probs)


@pytest.mark.parametrize("vocab,width,peaked", [(5, 3, False), (8, 4, True), (3, 3, True)])
def test_siblings_drawn_without_replacement_are_verified_exactly(vocab, width, peaked):
    """10^5 rows: ``width`` root siblings drawn without replacement from q (a ``without_replacement`` tree, each
    tested against its own law, q minus the earlier siblings, with the residual carried on), one child each:
    the first token follows p exactly and the pair follows the target's joint; vocab 3 with width 3 exhausts
    the support (repeated siblings are skipped)."""
    from mmspec.sampling import sample_without_replacement

    g = torch.Generator().manual_seed(vocab)
    rows = 100_000
    p0, q0 = make_dist(1, 1, vocab, peaked, g)[0, 0], make_dist(1, 1, vocab, peaked, g)[0, 0]
    p1 = make_dist(1, vocab, vocab, peaked, g)[0]  # [V, V] the target after each first token
    siblings = sample_without_replacement(q0.expand(rows, -1), width, g)  # [rows, K]
    assert (siblings.sort(-1).values.diff(dim=-1) > 0).all() or vocab < 2 * width
    children = sample(p1[siblings], g)  # one child per sibling, drawn from the target itself
    tokens = torch.cat([siblings, children], 1)
    parents = torch.tensor([-1] * width + list(range(width)))
    draft = torch.cat([q0.expand(rows, width, -1), p1[siblings]], 1)
    tree = DraftTree(tokens, parents.expand(rows, -1), draft, without_replacement=True)
    target = torch.cat([p0.expand(rows, 1, -1), p1[tokens]], 1)
    result = verify_tree(tree, target, ExactRule(), g)
    assert chi_square_pvalue(empirical(result.tokens[:, 0], vocab), p0) > P_VALUE_FLOOR
    first = result.tokens[:, 0]  # rows that rejected every sibling draw their second token from the target
    second = torch.where(result.num_accepted > 0, result.tokens[:, 1], sample(p1[first], g))
    pair = first * vocab + second
    assert chi_square_pvalue(empirical(pair, vocab * vocab), (p0.unsqueeze(1) * p1).flatten()) > P_VALUE_FLOOR
    accepted_later = (result.path[:, 0] >= 1).float().mean()
    assert accepted_later > 0.01  # later siblings do get accepted
    # the same siblings read as independent draws (the default) are not the target's law
    naive = verify_tree(DraftTree(tokens, parents.expand(rows, -1), draft), target, ExactRule(), g)
    assert chi_square_pvalue(empirical(naive.tokens[:, 0], vocab), p0) < P_VALUE_FLOOR


def test_sibling_laws_without_replacement_remove_earlier_siblings_and_mark_repeats():
    from mmspec.tree import sibling_laws_without_replacement

    q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    tree = DraftTree(torch.tensor([[0, 1, 0, 2]]), torch.tensor([[-1, -1, -1, 0]]), q.expand(1, 4, -1),
                     without_replacement=True)
    laws, repeated = sibling_laws_without_replacement(tree)
    assert torch.allclose(laws[0, 0], q) and torch.allclose(laws[0, 3], q)  # a first sibling, a first child
    assert torch.allclose(laws[0, 1], torch.tensor([0.0, 0.6, 0.4], dtype=torch.float64))
    assert repeated.tolist() == [[False, False, True, False]]
