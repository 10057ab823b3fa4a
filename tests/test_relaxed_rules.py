"""Entropy-aware and Cool-SD relaxed acceptance (mmspec.relaxed_rules, mmspec.methods.relaxed).

The formulas are re-derived here from the papers' descriptions: entropy-aware acceptance (Ma et al., arXiv
2510.09012, Sec. "entropy-aware acceptance": the relaxation set from the entropy of the target's distribution;
the released krennic999/ARsample LlamaGen/autoregressive/models/generate.py maps entropy through exp(-H / 3))
and Cool-SD (Li et al., arXiv 2601.09212: the TV-optimal resampling distribution norm(max(0, p - q a)) of
relaxed speculative sampling, and a relaxation annealed over the image; xingyaoL/COOL-SD has no code yet).
The relaxed mass over codebook neighbours is LANTERN++'s (arXiv 2502.06352), checked by a plain loop.
"""

from __future__ import annotations

import math

import pytest
import torch
from stats_utils import P_VALUE_FLOOR, chi_square_pvalue, empirical
from test_ar_image_pipeline import PROMPTS, make_pipe

from mmspec.methods.eagle import EagleConfig, LanternConfig
from mmspec.methods.relaxed import CoolSDConfig, EntropySDConfig
from mmspec.relaxed_rules import (
    CoolRule,
    EntropyRule,
    ImagePositions,
    entropy,
    tv_optimal_residual,
)
from mmspec.rules import ExactRule, GreedyRule, LanternRule, exact_residual
from mmspec.tree import DraftTree, verify_tree
from mmspec.validation import NonFiniteProbabilitiesError, value_checks
from mmspec.verify import verify_tokens

VOCABS = (5, 37, 256)


def _neighbors(vocab: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codebook = torch.randn(vocab, 3, generator=g, dtype=torch.float64)
    dist = torch.cdist(codebook, codebook)
    dist.fill_diagonal_(float("inf"))
    return dist.argsort(-1)[:, :k]


def _dists(shape: tuple[int, ...], vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * scale).softmax(-1)


def _lantern_mass(p: torch.Tensor, token: int, neighbors: torch.Tensor | None, k: int, lam: float) -> float:
    """LANTERN++'s relaxed mass of one token by a plain loop: p(x) plus the longest distance-ordered prefix of
    its neighbours whose mass stays within (lam - 1) p(x); lam p(x) without a neighbour table."""
    px = float(p[token])
    if neighbors is None:
        return lam * px
    budget, total = (lam - 1.0) * px, 0.0
    for y in neighbors[token, :k].tolist():
        if total + float(p[y]) > budget:
            break
        total += float(p[y])
    return px + total


def _entropy_lam(p: torch.Tensor, lam_max: float, scale: float) -> float:
    h = -sum(float(v) * math.log(float(v)) for v in p.tolist() if v > 0)
    return 1.0 + (lam_max - 1.0) * (1.0 - math.exp(-h / scale))


def _cool_lam(position: int, length: int, lam_start: float, lam_end: float, decay: float) -> float:
    s = min(position / (length - 1), 1.0)
    return lam_end + (lam_start - lam_end) * math.exp(-decay * s)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("table", [True, False], ids=["neighbors", "scaled"])
def test_entropy_rule_matches_the_formula(vocab, table):
    k = min(8, vocab - 1)
    neighbors = _neighbors(vocab, k) if table else None
    rule = EntropyRule(neighbors, k=k, lam_max=7.0, scale=1.5)
    for chain in (1, 3, 8):
        p = _dists((3, chain), vocab, seed=chain)
        q = _dists((3, chain), vocab, seed=100 + chain, scale=1.0)
        tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=torch.Generator().manual_seed(chain))
        tokens = tokens.reshape(3, chain)
        target_mass, draft_mass = rule.masses(p, q, tokens)
        for b in range(3):
            for i in range(chain):
                lam = _entropy_lam(p[b, i], 7.0, 1.5)
                want = _lantern_mass(p[b, i], int(tokens[b, i]), neighbors, k, lam)
                assert target_mass[b, i].item() == pytest.approx(want, rel=1e-9, abs=1e-12)
                assert draft_mass[b, i].item() == pytest.approx(float(q[b, i, tokens[b, i]]))


def test_entropy_relaxes_flat_distributions_more_than_peaked_ones():
    flat = torch.full((1, 1, 64), 1 / 64, dtype=torch.float64)
    peaked = torch.softmax(torch.arange(64, dtype=torch.float64) * 0.5, -1).reshape(1, 1, 64)
    rule = EntropyRule(lam_max=9.0, scale=2.0)
    token = torch.zeros(1, 1, dtype=torch.long)
    lam_flat = rule.masses(flat, None, token)[0] / flat[0, 0, 0]
    lam_peaked = rule.masses(peaked, None, token)[0] / peaked[0, 0, 0]
    assert entropy(flat).item() == pytest.approx(math.log(64))
    assert 1.0 < lam_peaked.item() < lam_flat.item() < 9.0


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("table", [True, False], ids=["neighbors", "scaled"])
def test_cool_rule_follows_its_schedule_over_the_image(vocab, table):
    k = min(6, vocab - 1)
    neighbors = _neighbors(vocab, k, seed=1) if table else None
    rule = CoolRule(neighbors, k=k, length=40, lam_start=12.0, lam_end=2.0, decay=2.5)
    rule.positions.advance(torch.tensor([[5, 1, -1], [7, -1, -1], [1, 2, 3]]))  # rows at 2, 1 and 3 tokens
    offsets = [2, 1, 3]
    for chain in (1, 4, 8):
        p = _dists((3, chain), vocab, seed=7 + chain)
        tokens = p.reshape(-1, vocab).argmax(-1).reshape(3, chain)
        depths = torch.arange(1, chain + 1)
        target_mass, draft_mass = rule.masses_at(p, None, tokens, depths)
        assert torch.equal(draft_mass, torch.ones_like(draft_mass))
        for b in range(3):
            for i in range(chain):
                lam = _cool_lam(offsets[b] + i, 40, 12.0, 2.0, 2.5)
                want = _lantern_mass(p[b, i], int(tokens[b, i]), neighbors, k, lam)
                assert target_mass[b, i].item() == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_cool_schedule_cools_and_a_zero_decay_is_uniform():
    rule = CoolRule(length=101, lam_start=20.0, lam_end=2.0, decay=4.0)
    lam = rule.schedule(torch.arange(0, 101, 10))
    assert lam[0].item() == pytest.approx(20.0)
    assert lam[-1].item() == pytest.approx(2.0 + 18.0 * math.exp(-4.0))
    assert bool((lam[1:] < lam[:-1]).all())
    uniform = CoolRule(length=101, lam_start=5.0, lam_end=1.0, decay=0.0).schedule(torch.arange(101))
    assert torch.allclose(uniform, torch.full_like(uniform, 5.0))


def test_uniform_cool_rule_is_lantern_plus_plus():
    vocab, k = 37, 8
    neighbors = _neighbors(vocab, k)
    cool = CoolRule(neighbors, k=k, length=64, lam_start=4.0, lam_end=4.0, decay=1.0)
    cool.positions.advance(torch.tensor([[1], [1]]))
    lantern = LanternRule(neighbors, k=k, lam=4.0)
    p = _dists((2, 5), vocab, seed=3)
    tokens = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(3))
    ours = cool.masses_at(p, None, tokens, torch.arange(1, 6))[0]
    assert torch.allclose(ours, lantern.masses(p, None, tokens)[0])


def _rules_without_relaxation(vocab: int, greedy: bool):
    neighbors = _neighbors(vocab, min(8, vocab - 1))
    k = min(8, vocab - 1)
    yield EntropyRule(neighbors, k=k, lam_max=1.0, greedy=greedy)
    yield EntropyRule(None, lam_max=1.0, greedy=greedy)
    cool = CoolRule(neighbors, k=k, length=32, lam_start=1.0, lam_end=1.0, greedy=greedy)
    cool.positions.advance(torch.tensor([[1], [1], [1], [1]]))
    yield cool


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("stochastic", [False, True])
def test_zero_relaxation_verifies_like_the_exact_rule(vocab, greedy, stochastic):
    exact = GreedyRule() if greedy else ExactRule()
    for rule in _rules_without_relaxation(vocab, greedy):
        for chain in (1, 2, 8):
            p = _dists((4, chain + 1), vocab, seed=chain)
            q = _dists((4, chain), vocab, seed=50 + chain) if stochastic else None
            source = q if q is not None else p[:, :chain]
            drafts = torch.multinomial(source.reshape(-1, vocab), 1, generator=torch.Generator().manual_seed(2))
            drafts = drafts.reshape(4, chain)
            ours = verify_tokens(drafts, q, p, rule, torch.Generator().manual_seed(9))
            theirs = verify_tokens(drafts, q, p, exact, torch.Generator().manual_seed(9))
            assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.num_accepted, theirs.num_accepted)


@pytest.mark.slow
@pytest.mark.parametrize("rule", [EntropyRule(lam_max=1.0), CoolRule(length=4, lam_start=1.0, lam_end=1.0)],
                         ids=["entropy", "cool"])
def test_zero_relaxation_samples_the_target(rule):
    """10^5 single-draft rounds: the emitted token is distributed as the target's p (chi-square)."""
    vocab, rows = 12, 100_000
    p = _dists((1, 2), vocab, seed=11, scale=1.5).expand(rows, -1, -1).contiguous()
    q = _dists((1, 1), vocab, seed=12, scale=1.5).expand(rows, -1, -1).contiguous()
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q[:, 0], 1, generator=g)
    if isinstance(rule, CoolRule):
        rule.positions.advance(torch.ones(rows, 1, dtype=torch.long))
    out = verify_tokens(drafts, q, p, rule, g)
    assert chi_square_pvalue(empirical(out.tokens[:, 0], vocab), p[0, 0]) > P_VALUE_FLOOR


@pytest.mark.parametrize("vocab", VOCABS)
def test_residual_is_the_tv_optimal_distribution(vocab):
    """Cool-SD's resampling distribution norm(max(0, p - q a)) with the rule's acceptance a >= min(1, p / q)
    is the exact residual, a distribution, and no other residual (p itself) brings the output closer to p."""
    rule = EntropyRule(lam_max=5.0)
    p, q = _dists((3,), vocab, seed=21), _dists((3,), vocab, seed=22, scale=1.0)
    tokens = q.argmax(-1)
    residual = rule.residual(p, q, tokens)
    assert torch.equal(residual, exact_residual(p, q, tokens))
    assert bool((residual >= 0).all()) and bool((residual.sum(-1) > 0).all())
    every = torch.arange(vocab).expand(3, -1)
    acceptance = rule.acceptance_probs(p.unsqueeze(-2).expand(-1, vocab, -1), q.unsqueeze(-2).expand(-1, vocab, -1),
                                       every)  # a(y) for every y
    assert bool((acceptance >= torch.minimum(torch.ones_like(p), p / q) - 1e-12).all())
    optimal = tv_optimal_residual(p, q, tokens, acceptance)
    assert torch.allclose(optimal / optimal.sum(-1, keepdim=True), residual / residual.sum(-1, keepdim=True))

    def tv_to_target(r):
        kept = q * acceptance
        out = kept + (1 - kept.sum(-1, keepdim=True)) * r / r.sum(-1, keepdim=True)
        return 0.5 * (out - p).abs().sum(-1)

    assert bool((tv_to_target(residual) <= tv_to_target(p) + 1e-12).all())


def test_nan_rows_are_refused():
    p = _dists((2, 3), 16, seed=1)
    p[1, 2, 4] = float("nan")
    tokens = torch.zeros(2, 3, dtype=torch.long)
    cool = CoolRule(length=16)
    cool.positions.advance(torch.tensor([[1], [1]]))
    with value_checks(True):
        for rule in (EntropyRule(), cool):
            with pytest.raises(NonFiniteProbabilitiesError, match=r"target distribution.*row \[1, 2\]"):
                rule.masses_at(p, None, tokens, torch.arange(1, 4))
            with pytest.raises(NonFiniteProbabilitiesError, match="target distribution"):
                rule.residual(p[:, 2], None, tokens[:, 2])


def test_cool_rule_needs_positions():
    p = _dists((1, 2), 8, seed=0)
    tokens = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="positioned_generate"):
        CoolRule(length=8).masses_at(p, None, tokens, torch.arange(1, 3))
    with pytest.raises(ValueError, match="depth"):
        CoolRule(length=8).masses(p, None, tokens)
    positions = ImagePositions()
    positions.advance(torch.tensor([[3, 4, -1]]))
    positions.advance(torch.tensor([[1, -1, -1]]))
    assert positions.positions(torch.arange(1, 3), tokens).tolist() == [[3, 4]]


def test_tree_verification_passes_each_node_its_depth():
    """A one-path tree is a chain: the same decisions, so the tree's nodes got their depths."""
    vocab = 37
    neighbors = _neighbors(vocab, 8)
    rule = CoolRule(neighbors, k=8, length=16, lam_start=30.0, lam_end=1.0, decay=6.0)
    rule.positions.advance(torch.tensor([[1, 2, 3], [1, -1, -1]]))
    p = _dists((2, 5), vocab, seed=5, scale=1.0)
    drafts = torch.randint(0, vocab, (2, 4), generator=torch.Generator().manual_seed(1))
    tree = DraftTree(tokens=drafts, parents=torch.tensor([[-1, 0, 1, 2]] * 2), draft_probs=None)
    chain = verify_tokens(drafts, None, p, rule, torch.Generator().manual_seed(4))
    walked = verify_tree(tree, p, rule, torch.Generator().manual_seed(4))
    assert torch.equal(chain.num_accepted, walked.num_accepted)
    assert torch.equal(chain.tokens[:, :-1][chain.tokens[:, :-1] >= 0], walked.tokens[:, :-1][walked.tokens[:, :-1] >= 0])


@pytest.mark.parametrize(("config", "field"), [
    (lambda: EntropySDConfig(lam_max=0.5), "lam_max"),
    (lambda: EntropySDConfig(entropy_scale=0.0), "entropy_scale"),
    (lambda: CoolSDConfig(lam_end=0.9), "lam_end"),
    (lambda: CoolSDConfig(lam_start=2.0, lam_end=3.0), "lam_start"),
    (lambda: CoolSDConfig(decay=-1.0), "decay"),
    (lambda: CoolSDConfig(relaxation="rank"), "relaxation"),
    (lambda: CoolRule(lam_start=0.5, lam_end=1.0), "lam_start"),
    (lambda: EntropyRule(scale=float("nan")), "scale"),
])
def test_bad_settings_raise_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        config()


# -- the methods in the pipeline ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pipe():
    return make_pipe()


def _run(pipe, method, do_sample, seed=0, **kwargs):
    return pipe(PROMPTS, method=method, output_type="tokens", do_sample=do_sample,
                generator=torch.Generator().manual_seed(seed), **kwargs)


def _tokens(pipe, method, do_sample, seed=0, **kwargs):
    return _run(pipe, method, do_sample, seed, **kwargs).tokens


@pytest.mark.parametrize(("do_sample", "configs"), [
    (False, [CoolSDConfig(lam_start=1.0)]),
    (True, [EntropySDConfig(lam_max=1.0), CoolSDConfig(lam_start=1.0, relaxation="scaled")]),
])
def test_methods_without_relaxation_reproduce_eagle(pipe, do_sample, configs):
    eagle = _tokens(pipe, EagleConfig(), do_sample)
    for config in configs:
        assert torch.equal(_tokens(pipe, config, do_sample), eagle)


@pytest.mark.parametrize("config", [EntropySDConfig(lam_max=50.0, relaxation="scaled"),
                                    CoolSDConfig(lam_start=50.0, lam_end=20.0, relaxation="scaled")],
                         ids=["entropy_sd", "cool_sd"])
def test_relaxation_accepts_more_drafts_than_eagle(pipe, config):
    eagle = _run(pipe, EagleConfig(), True, seed=1).stats.mean_accepted_drafts
    assert _run(pipe, config, True, seed=1).stats.mean_accepted_drafts > eagle


def test_uniform_cool_sd_in_the_pipeline_is_lantern_plus_plus(pipe):
    lantern = _tokens(pipe, LanternConfig(k=16, lam=6.0), True, seed=3)
    cool = _tokens(pipe, CoolSDConfig(k=16, lam_start=6.0, lam_end=6.0), True, seed=3)
    assert torch.equal(cool, lantern)


@pytest.mark.parametrize("method", ["entropy_sd", "cool_sd"])
def test_registered_methods_run_by_name(pipe, method):
    assert method in pipe.methods()
    for do_sample in (False, True):
        tokens = _tokens(pipe, method, do_sample)
        assert tokens.shape[0] == len(PROMPTS) and bool((tokens >= 0).all())


def test_cool_sd_places_every_draft_in_the_image(pipe):
    """The rule sees raster positions that start after the first token and reach the image's end (drafts a row
    cannot keep may lie past it, where the schedule holds its last value)."""
    seen: list[torch.Tensor] = []

    class Spy(CoolRule):
        def factors(self, target_probs, tokens, depths):
            seen.append(self.positions.positions(depths, tokens).flatten())
            return super().factors(target_probs, tokens, depths)

    length = int(pipe.transformer.config.block_size)
    spy = Spy(pipe.codebook_neighbors(8), k=8, length=length, lam_start=3.0)
    _tokens(pipe, CoolSDConfig(k=8, lam_start=3.0), True, rule=spy)
    positions = torch.cat(seen)
    assert positions.min().item() == 1 and positions.max().item() >= length - 1
    assert spy.schedule(torch.tensor([length - 1, length + 5])).unique().numel() == 1
    assert spy.positions.offsets is None  # reset after the call
