"""verify_tokens and the acceptance rules: losslessness, greedy exactness, relaxations, bad input."""

from __future__ import annotations

import pytest
import torch
from stats_utils import P_VALUE_FLOOR, chi_square_pvalue, empirical, make_dist, total_variation

from mmspec import ExactRule, GreedyRule, GroupedRule, LanternRule, PoolingThresholdRule, verify_tokens
from mmspec.sampling import sample


class MarkovWorld:
    """Target and draft are first-order Markov chains over V tokens, different per position.

    ``target[j, a]`` is the target distribution of the token at absolute position j after token a (a = V
    is the start state), so exact marginals of every position are known in closed form.
    """

    def __init__(self, vocab: int, length: int, num_draft: int, peaked: bool, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        steps = length + num_draft + 1
        self.vocab, self.length = vocab, length
        self.target = make_dist(steps, vocab + 1, vocab, peaked, g)  # [steps, V+1, V]
        # the draft is a perturbed target: realistic partial agreement
        noise = make_dist(steps, vocab + 1, vocab, peaked, g)
        self.draft = 0.6 * self.target + 0.4 * noise

    def marginals(self) -> torch.Tensor:
        """Exact marginal distribution of each absolute position ``[length, V]``."""
        m = self.target[0, self.vocab]
        out = [m]
        for j in range(1, self.length):
            m = m @ self.target[j, : self.vocab]
            out.append(m)
        return torch.stack(out)

    def pair_joint(self) -> torch.Tensor:
        """Exact joint of positions 0 and 1, ``[V * V]``."""
        first = self.target[0, self.vocab]
        return (first.unsqueeze(1) * self.target[1, : self.vocab]).flatten()


def run_chain(world: MarkovWorld, rows: int, num_draft: int, rule, stochastic_drafts: bool, seed: int) -> torch.Tensor:
    """Generate ``world.length`` tokens per row with speculative rounds; returns ``[rows, length]``."""
    g = torch.Generator().manual_seed(seed)
    vocab, length = world.vocab, world.length
    out = torch.full((rows, length + num_draft + 1), -1, dtype=torch.long)
    pos = torch.zeros(rows, dtype=torch.long)  # tokens produced so far
    prev = torch.full((rows,), vocab, dtype=torch.long)  # start state
    while (pos < length).any():
        pos = pos.clamp(max=length)  # finished rows idle at the end (their later tokens are discarded)
        drafts, qs, ps = [], [], []
        state = prev
        for i in range(num_draft):
            q = world.draft[pos + i, state]  # [rows, V]
            token = sample(q, g) if stochastic_drafts else q.argmax(-1)
            ps.append(world.target[pos + i, state])
            drafts.append(token)
            qs.append(q)
            state = token
        ps.append(world.target[pos + num_draft, state])
        result = verify_tokens(torch.stack(drafts, 1), torch.stack(qs, 1) if stochastic_drafts else None,
                               torch.stack(ps, 1), rule=rule, generator=g)
        emitted = result.num_accepted + 1
        idx = pos.unsqueeze(1) + torch.arange(num_draft + 1)
        keep = torch.arange(num_draft + 1) < emitted.unsqueeze(1)
        out.scatter_(1, torch.where(keep, idx, out.shape[1] - 1), torch.where(keep, result.tokens, -1))
        prev = result.tokens.gather(1, result.num_accepted.unsqueeze(1)).squeeze(1)
        pos = pos + emitted
    return out[:, :length]


CASES = [  # (vocab, K, peaked)
    (4, 1, False),
    (12, 4, True),
    pytest.param(40, 8, False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("stochastic_drafts", [True, False], ids=["draft_probs", "deterministic"])
@pytest.mark.parametrize("vocab,num_draft,peaked", CASES)
def test_exact_rule_is_lossless(vocab, num_draft, peaked, stochastic_drafts):
    """Every emitted position follows the target: 10^5 rows, chi-square p > 1e-4 and TV < 0.01."""
    world = MarkovWorld(vocab, length=5, num_draft=num_draft, peaked=peaked, seed=vocab + num_draft)
    tokens = run_chain(world, rows=100_000, num_draft=num_draft, rule=ExactRule(),
                       stochastic_drafts=stochastic_drafts, seed=1)
    for j, marginal in enumerate(world.marginals()):
        counts = empirical(tokens[:, j], vocab)
        assert chi_square_pvalue(counts, marginal) > P_VALUE_FLOOR, f"position {j}"
        assert total_variation(counts, marginal) < 0.01
    if vocab <= 12:  # joint of two positions catches dependence errors marginals miss
        pair = tokens[:, 0] * vocab + tokens[:, 1]
        assert chi_square_pvalue(empirical(pair, vocab * vocab), world.pair_joint()) > P_VALUE_FLOOR


def test_lossless_detects_a_broken_rule():
    """Sanity check of the test itself: accepting every draft is visibly not lossless."""

    class AcceptAll(ExactRule):
        def masses(self, target_probs, draft_probs, tokens):
            ones = torch.ones(tokens.shape, dtype=target_probs.dtype)
            return ones, ones * 0.5

    world = MarkovWorld(6, length=3, num_draft=2, peaked=False, seed=3)
    tokens = run_chain(world, rows=20_000, num_draft=2, rule=AcceptAll(), stochastic_drafts=True, seed=1)
    p_values = [chi_square_pvalue(empirical(tokens[:, j], 6), m) for j, m in enumerate(world.marginals())]
    assert min(p_values) < 1e-10


def test_greedy_rule_emits_the_target_argmax_chain():
    g = torch.Generator().manual_seed(0)
    target = make_dist(64, 7, 50, peaked=True, generator=g)
    argmax = target.argmax(-1)
    drafts = argmax[:, :6].clone()
    corrupt = torch.rand(64, 6, generator=g) < 0.2
    drafts[corrupt] = (drafts[corrupt] + 1) % 50
    result = verify_tokens(drafts, None, target, rule=GreedyRule())
    first_bad = torch.where(corrupt.any(1), corrupt.float().argmax(1), 6)
    assert torch.equal(result.num_accepted, first_bad)
    for b in range(64):
        n = int(first_bad[b])
        assert torch.equal(result.tokens[b, : n + 1], argmax[b, : n + 1])
        assert (result.tokens[b, n + 1:] == -1).all()


def test_greedy_fast_path_equals_the_reference_path_with_ties_and_full_acceptance():
    """verify_tokens decides GreedyRule chains from the argmax alone; a subclass of the rule takes the generic
    path (uniform draws, masses, residual), and both must agree token for token."""

    class ReferenceGreedy(GreedyRule):
        pass

    g = torch.Generator().manual_seed(3)
    target = make_dist(48, 6, 20, peaked=True, generator=g)
    target[:8, :, :4] = 0.25  # ties: four equally likely tokens, argmax takes the lowest id
    target[:8, :, 4:] = 0.0
    drafts = target.argmax(-1)[:, :5].clone()
    wrong = torch.rand(48, 5, generator=g) < 0.25
    wrong[:6] = False  # some rows accept every draft
    drafts[wrong] = (drafts[wrong] + 1) % 20
    fast = verify_tokens(drafts, None, target, rule=GreedyRule())
    reference = verify_tokens(drafts, None, target, rule=ReferenceGreedy())
    assert torch.equal(fast.num_accepted, reference.num_accepted) and torch.equal(fast.tokens, reference.tokens)
    assert (fast.num_accepted == 5).sum() >= 6 and (fast.num_accepted < 5).any()
    # the host copy of the counts (decided there by the fast path, read once by the reference's)
    assert fast.accepted_counts() == reference.accepted_counts() == reference.num_accepted.tolist()
    assert fast.tokens.dtype == fast.num_accepted.dtype == torch.long


def test_output_layout_and_generator_determinism():
    g = torch.Generator().manual_seed(0)
    target = make_dist(8, 5, 30, peaked=False, generator=g)
    q = make_dist(8, 4, 30, peaked=False, generator=g)
    drafts = sample(q, g)
    a = verify_tokens(drafts, q, target, generator=torch.Generator().manual_seed(7))
    b = verify_tokens(drafts, q, target, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    for row in range(8):
        n = int(a.num_accepted[row])
        assert torch.equal(a.tokens[row, :n], drafts[row, :n])
        assert a.tokens[row, n] >= 0 and (a.tokens[row, n + 1:] == -1).all()


def _neighbors(vocab: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codebook = torch.randn(vocab, 4, generator=g)
    dist = torch.cdist(codebook, codebook)
    dist.fill_diagonal_(float("inf"))
    return dist.argsort(-1)[:, :k]


def _same_outputs(rule_a, rule_b, stochastic: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = make_dist(256, 5, 32, peaked=False, generator=g)
    q = make_dist(256, 4, 32, peaked=False, generator=g)
    drafts = sample(q, g) if stochastic else q.argmax(-1)
    draft_probs = q if stochastic else None
    a = verify_tokens(drafts, draft_probs, target, rule_a, torch.Generator().manual_seed(1))
    b = verify_tokens(drafts, draft_probs, target, rule_b, torch.Generator().manual_seed(1))
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


@pytest.mark.parametrize("stochastic", [True, False])
def test_lantern_delta_zero_and_gsd_g1_equal_exact(stochastic):
    neighbors = _neighbors(32, 8)
    assert _same_outputs(LanternRule(neighbors, k=8, delta=0.0), ExactRule(), stochastic)
    assert _same_outputs(LanternRule(neighbors, k=8, lam=1.0), ExactRule(), stochastic)
    assert _same_outputs(GroupedRule(G=1), ExactRule(), stochastic)


def test_lantern_delta_zero_and_gsd_g1_match_exact_in_distribution():
    world = MarkovWorld(6, length=4, num_draft=3, peaked=False, seed=11)
    for rule in (LanternRule(_neighbors(6, 3), k=3, delta=0.0), GroupedRule(G=1)):
        tokens = run_chain(world, rows=50_000, num_draft=3, rule=rule, stochastic_drafts=True, seed=2)
        for j, marginal in enumerate(world.marginals()):
            assert chi_square_pvalue(empirical(tokens[:, j], 6), marginal) > P_VALUE_FLOOR


def test_acceptance_grows_with_delta_lam_and_group_size():
    g = torch.Generator().manual_seed(0)
    target = make_dist(512, 1, 64, peaked=False, generator=g)[:, 0]
    q = make_dist(512, 1, 64, peaked=False, generator=g)[:, 0]
    tokens = sample(q, g)
    neighbors = _neighbors(64, 16)
    previous = torch.zeros(512, dtype=torch.float64)
    for delta in (0.0, 0.01, 0.05, 0.1, 0.3, 1.0):
        acc = LanternRule(neighbors, k=16, delta=delta).acceptance_probs(target, q, tokens)
        assert (acc >= previous - 1e-12).all()
        previous = acc
    assert previous.mean() > ExactRule().acceptance_probs(target, q, tokens).mean() + 0.05
    previous = torch.zeros(512, dtype=torch.float64)
    for lam in (1.0, 1.5, 2.0, 4.0):
        acc = LanternRule(neighbors, k=16, lam=lam).acceptance_probs(target, q, tokens)
        assert (acc >= previous - 1e-12).all()
        previous = acc
    # GSD: groups are nested in G; with deterministic drafts q(C) = 1 so acceptance is monotone.
    previous = torch.zeros(512, dtype=torch.float64)
    for group in (1, 2, 3, 5, 10, 30):
        acc = GroupedRule(G=group, prob_threshold=1.0).acceptance_probs(target, None, tokens)
        assert (acc >= previous - 1e-12).all()
        previous = acc
    assert previous.mean() > target.gather(1, tokens[:, None]).mean() + 0.1


def test_gsd_group_filters():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]], dtype=torch.float64)
    token = torch.tensor([2])
    wide = GroupedRule(G=5, prob_threshold=1.0).group_mask(probs, token)
    assert wide.tolist() == [[True, True, True, True, True]]
    tight = GroupedRule(G=5, prob_threshold=0.1).group_mask(probs, token)
    assert tight.tolist() == [[False, False, True, True, True]]  # |0.3 - 0.1| >= 0.1 drops token 1
    emb = torch.tensor([[0.0], [0.0], [0.0], [5.0], [0.1]])
    near = GroupedRule(G=5, prob_threshold=1.0, embeddings=emb, distance_threshold=1.0).group_mask(probs, token)
    assert near.tolist() == [[True, True, True, False, True]]


def _reference_group_mask(probs: torch.Tensor, tokens: torch.Tensor, G: int, threshold: float) -> torch.Tensor:
    """GSD's group by a full stable sort (probability descending, token id ascending), one row at a time."""
    mask = torch.zeros_like(probs, dtype=torch.bool)
    above, below = -(-(G - 1) // 2), (G - 1) // 2
    for row in range(probs.shape[0]):
        order = sorted(range(probs.shape[1]), key=lambda t: (-float(probs[row, t]), t))
        rank = order.index(int(tokens[row]))
        for y in order[max(0, rank - above): rank + below + 1]:
            mask[row, y] = abs(float(probs[row, y]) - float(probs[row, tokens[row]])) < threshold
        mask[row, tokens[row]] = True
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_gsd_group_equals_a_full_sort_with_ties_and_edges(dtype):
    """The topk-based group equals the sorted-ranking definition, including tied probabilities (zeros
    left by top-k filtering, exact duplicates), drafts at the top and bottom of the ranking, and G larger
    than the vocabulary."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 40, generator=gen, dtype=torch.float64) * 2, -1)
    probs[:16, 20:] = 0.0  # filtered tokens: long runs of ties at zero
    probs[16:32, 1] = probs[16:32, 5]  # exact duplicates
    probs = (probs / probs.sum(-1, keepdim=True)).to(dtype)
    tokens = torch.randint(0, 40, (64,), generator=gen)
    tokens[:8] = 25  # a zero-probability token among ties
    tokens[32:40] = probs[32:40].float().argmax(-1)  # top of the ranking
    tokens[40:48] = probs[40:48].float().argmin(-1)  # bottom of the ranking
    for G, threshold in ((2, 1.0), (5, 1.0), (6, 0.02), (11, 0.1), (64, 1.0)):
        got = GroupedRule(G=G, prob_threshold=threshold).group_mask(probs, tokens)
        expected = _reference_group_mask(probs.float(), tokens, G, threshold)
        assert torch.equal(got, expected), (G, threshold)


def test_lantern_relaxed_mass_is_a_distance_ordered_prefix():
    probs = torch.tensor([[0.4, 0.05, 0.1, 0.2, 0.25]], dtype=torch.float64)
    neighbors = torch.tensor([[1, 2, 3, 4], [0, 2, 3, 4], [1, 0, 3, 4], [4, 2, 1, 0], [3, 2, 1, 0]])
    rule = LanternRule(neighbors, k=4, delta=0.17)
    # token 0: neighbours 1 (0.05), 2 (0.1) -> cumulative 0.15 <= 0.17, then 3 (0.2) breaks the budget
    assert rule.relaxed_mass(probs, torch.tensor([0])).item() == pytest.approx(0.55)
    greedy = LanternRule(neighbors, k=4, delta=0.17, greedy=True)
    # token 2 (0.1) + neighbours 1 (0.05) -> 0.15 (next, 0 at 0.4, exceeds): not the argmax (0.4)
    assert greedy.acceptance_probs(probs, None, torch.tensor([2])).item() == 0.0
    assert greedy.acceptance_probs(probs, None, torch.tensor([0])).item() == 1.0


def test_lantern_official_residual_zeroes_neighbours():
    probs = torch.tensor([[0.4, 0.05, 0.1, 0.2, 0.25]], dtype=torch.float64)
    neighbors = torch.tensor([[1, 2], [0, 2], [1, 0], [4, 2], [3, 2]])
    tv = LanternRule(neighbors, k=2, delta=0.1).residual(probs, None, torch.tensor([0]))
    official = LanternRule(neighbors, k=1, delta=0.1, residual_kind="zero_target_neighbors").residual(
        probs, None, torch.tensor([0]))  # zeroes x and its k + 1 = 2 nearest neighbours
    assert tv[0, 0] == 0 and tv[0, 1] > 0
    assert official[0, :3].tolist() == [0, 0, 0] and official[0, 3] > 0


def test_pooling_threshold_rule():
    probs = torch.tensor([[0.3, 0.25, 0.05, 0.2, 0.2]], dtype=torch.float64)
    neighbors = torch.tensor([[1, 2], [0, 2], [1, 0], [4, 2], [3, 2]])
    rule = PoolingThresholdRule(neighbors, k=1, tau=0.4)
    # token 3: 0.2 + neighbour 4 (0.2) = 0.4 -> accepted; token 2: 0.05 + 0.25 = 0.3 -> rejected
    assert rule.acceptance_probs(probs, None, torch.tensor([3])).item() == 1.0
    assert rule.acceptance_probs(probs, None, torch.tensor([2])).item() == 0.0
    result = verify_tokens(torch.tensor([[3, 2]]), None, probs.expand(1, 3, 5).contiguous(), rule,
                           torch.Generator().manual_seed(0))
    assert result.num_accepted.item() == 1


# ------------------------------------------------------------------------------------------- bad input

def _valid_inputs():
    g = torch.Generator().manual_seed(0)
    return sample(make_dist(2, 3, 10, False, g), g), make_dist(2, 3, 10, False, g), make_dist(2, 4, 10, False, g)


@pytest.mark.parametrize("mutate,message", [
    (lambda d, q, p: (d[:, :0], None, p[:, :1]), "K=0"),
    (lambda d, q, p: (d, q, p[:, :3]), "target_probs must have shape"),
    (lambda d, q, p: (d, q[..., :9], p), "vocab mismatch"),
    (lambda d, q, p: (d, q, -p), "negative"),
    (lambda d, q, p: (d, q, p * float("nan")), "NaN"),
    (lambda d, q, p: (d, q, p * 2), "not normalised"),
    (lambda d, q, p: (d, q.log(), p), "draft_probs"),
    (lambda d, q, p: (d + 10, q, p), "outside"),
    (lambda d, q, p: (d.float(), q, p), "integer"),
    (lambda d, q, p: (d[0], q, p), "draft_tokens must have shape"),
    (lambda d, q, p: (d, q[:1], p), "draft_probs must have shape"),
])
def test_bad_input_raises_clear_errors(mutate, message):
    d, q, p = mutate(*_valid_inputs())
    with pytest.raises(ValueError, match=message):
        verify_tokens(d, q, p)


def test_bad_rule_options():
    neighbors = _neighbors(10, 4)
    with pytest.raises(ValueError, match="delta"):
        LanternRule(neighbors, k=4, delta=1.5)
    with pytest.raises(ValueError, match="k=8 exceeds"):
        LanternRule(neighbors, k=8)
    with pytest.raises(ValueError, match="residual_kind"):
        LanternRule(neighbors, k=4, residual_kind="fancy")
    with pytest.raises(ValueError, match="G must be"):
        GroupedRule(G=0)
    with pytest.raises(ValueError, match="tau"):
        PoolingThresholdRule(neighbors, k=2, tau=2.0)
    with pytest.raises(ValueError, match="rule must be"):
        verify_tokens(*_valid_inputs(), rule="exact")
    d, q, p = _valid_inputs()
    with pytest.raises(ValueError, match="neighbors cover 12 tokens"):
        verify_tokens(d, q, p, rule=LanternRule(_neighbors(12, 4), k=4))


def test_pooling_residual_with_a_stochastic_draft_is_the_tv_form():
    probs = torch.tensor([[0.3, 0.25, 0.05, 0.2, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.1, 0.5, 0.2, 0.1]], dtype=torch.float64)
    neighbors = torch.tensor([[1, 2], [0, 2], [1, 0], [4, 2], [3, 2]])
    rule = PoolingThresholdRule(neighbors, k=1, tau=0.4)
    # pooled masses: 0.55, 0.55, 0.30, 0.40, 0.40 -> f = 1, 1, 0, 1, 1
    expected = (probs - q * torch.tensor([1.0, 1, 0, 1, 1], dtype=torch.float64)).clamp_min(0)
    assert torch.allclose(rule.residual(probs, q, torch.tensor([2])), expected)


def test_neighbour_tables_must_exclude_the_token_itself():
    with pytest.raises(ValueError, match="own token"):
        LanternRule(torch.arange(6).unsqueeze(1), k=1)


@pytest.mark.parametrize("greedy", [False, True])
def test_verify_tokens_uses_the_fused_kernel_identically(monkeypatch, greedy):
    """With the Triton backend forced (interpreter on CPU), verify_tokens returns exactly the torch result."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(4)
    target = make_dist(6, 5, 300, peaked=greedy, generator=g).float()
    q = make_dist(6, 4, 300, peaked=False, generator=g).float()
    drafts = target[:, :4].argmax(-1) if greedy else sample(q, g)
    if greedy:
        drafts[::2, 1] = (drafts[::2, 1] + 1) % 300
    rule = GreedyRule() if greedy else ExactRule()
    draft_probs = None if greedy else q
    monkeypatch.setenv("MMSPEC_KERNEL_BACKEND", "torch")
    a = verify_tokens(drafts, draft_probs, target, rule, torch.Generator().manual_seed(9))
    monkeypatch.setenv("MMSPEC_KERNEL_BACKEND", "triton")
    b = verify_tokens(drafts, draft_probs, target, rule, torch.Generator().manual_seed(9))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    assert a.num_accepted.min() < 4  # the comparison covers rejections


@pytest.mark.parametrize("peaked", [False, True])
def test_verify_positions_gives_each_position_its_target_and_keeps_one_minus_tv(peaked):
    """Per-position verdicts past rejections: 10^5 rows of 3 positions; every position's verdict follows its
    own target exactly, whatever happened before it, and keeps the draft with probability 1 - TV(p, q)."""
    from mmspec.verify import verify_positions

    g = torch.Generator().manual_seed(7)
    rows, vocab = 100_000, 6
    p, q = make_dist(1, 3, vocab, peaked, g)[0], make_dist(1, 3, vocab, peaked, g)[0]  # [3, V]
    drafts = sample(q.expand(rows, -1, -1), g)
    result = verify_positions(drafts, q.expand(rows, -1, -1), p.expand(rows, -1, -1), ExactRule(), g)
    assert result.tokens.shape == (rows, 3)
    for i in range(3):
        assert chi_square_pvalue(empirical(result.tokens[:, i], vocab), p[i]) > P_VALUE_FLOOR
        kept = float((result.tokens[:, i] == drafts[:, i]).double().mean())
        expected = 1 - 0.5 * float((p[i] - q[i]).abs().sum())
        assert abs(kept - expected) < 4 * (expected * (1 - expected) / rows) ** 0.5 + 1e-9
    assert torch.equal(result.num_accepted, (result.tokens == drafts).sum(1))
    greedy = verify_positions(drafts[:4], None, p.expand(4, -1, -1), GreedyRule())
    assert torch.equal(greedy.tokens, p.argmax(-1).expand(4, -1))
    with pytest.raises(ValueError, match="one distribution per position"):
        verify_positions(drafts[:4], None, p.expand(4, -1, -1)[:, :2], GreedyRule())
