"""The switches that reproduce the released code of LANTERN and GSD do reproduce it.

Each test compares mmspec with a re-derivation of the released logic written from reading it (the function
docstrings below cite repository, file, function and commit), on random inputs of several vocabulary sizes,
batch > 1 and chain lengths 1-8: with the same uniforms, identical decisions and tokens; with independent
draws, the same output distribution (10^5 draws, chi-square p-value above ``P_VALUE_FLOOR``, and the default
setting's distribution rejected by the same test, so the check has power).

Released code read:
* LANTERN: github.com/jadohu/LANTERN at commit 3a56e451dd5ebfa1903d044f754c68c420de27a9.
* GSD: github.com/junhyukso/GSD at commit 4216c7c2bd5d04be12410adb07143af4cd7f7b88.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from stats_utils import P_VALUE_FLOOR, chi_square_pvalue, empirical
from tiny_shapes_pipeline import tiny_shapes_pipeline

from mmspec import DraftTree, GroupedRule, LanternRule, verify_tokens, verify_tree
from mmspec.methods import BuildRequest
from mmspec.methods.eagle import LanternConfig
from mmspec.methods.jacobi import GSDConfig
from mmspec.sampling import SamplingConfig

F64 = torch.float64
VOCABS = (16, 37, 64)


# ----------------------------------------------------------------------------------------------------
# Re-derivations of the released code (one row at a time, as the released loops run)
# ----------------------------------------------------------------------------------------------------

def released_neighbor_table(gen: torch.Generator, vocab: int, dim: int = 4) -> torch.Tensor:
    """LANTERN entrypoints/generate_codebook.py, run_generate_codebook: every other codebook entry ordered
    by L2 distance (the diagonal set to infinity first, so a row never lists its own token): ``[V, V-1]``."""
    codebook = torch.randn(vocab, dim, generator=gen, dtype=F64)
    distances = torch.cdist(codebook, codebook)
    distances.fill_diagonal_(math.inf)
    return distances.argsort(dim=-1, stable=True)[:, : vocab - 1]


def released_relaxed_mass(gtp, x, nearest, k, delta, lam):
    """LANTERN models/ea_model_llamagen.py, EaModel.evaluate_posterior (sampling branch; the same lines in
    ea_model_anole.py and ea_model_lumina_mgpt.py): cumulative masses of nearest[x, :k]; the last index
    whose cumulative mass is within the budget (delta, or (lam - 1) px for LANTERN++) is added to px.
    Returns (relaxed px, whether any neighbour fitted: the released ``indices != -1``)."""
    px = gtp[x]
    cumulative = torch.cumsum(gtp[nearest[x, :k]], 0)
    budget = (lam - 1) * px if lam is not None else delta
    fitting = (cumulative <= budget).nonzero()
    if fitting.numel() == 0:
        return px, False
    return px + cumulative[fitting[-1, 0]], True


def released_rejection(gtp, x, q, fitted, nearest, k, zero):
    """What LANTERN's released code leaves to sample from after rejecting x (normalised).

    * q None (top-k drafts): EaModel.evaluate_posterior in ea_model_llamagen.py / ea_model_anole.py (and
      ea_model_lumina_mgpt.py with eagle_version 2): gtp[x] = 0, then, if a neighbour fitted,
      gtp[nearest[x, :k+1]] = 0.
    * zero == "target": ea_model_lumina_mgpt.py evaluate_posterior, eagle_version 1: if fitted,
      gtp[nearest[x, :k+1]] = 0; then gtp = max(0, gtp - q).
    * zero == "draft": ea_model_llamagen.py / ea_model_anole.py evaluate_posterior_v1: if fitted,
      q[nearest[x, :k+1]] = 0 (q not renormalised); then gtp = max(0, gtp - q).
    Then every path: an all-zero gtp becomes all ones; normalise."""
    gtp = gtp.clone()
    trimmed = nearest[x, : k + 1]
    if q is None:
        gtp[x] = 0
        if fitted:
            gtp[trimmed] = 0
    elif zero == "target":
        if fitted:
            gtp[trimmed] = 0
        gtp = gtp - q
        gtp[gtp < 0] = 0
    else:
        q = q.clone()
        if fitted:
            q[trimmed] = 0
        gtp = gtp - q
        gtp[gtp < 0] = 0
    if gtp.sum() == 0:
        gtp = torch.ones_like(gtp)
    return gtp / gtp.sum()


def pick(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw with a given uniform (the released code calls torch.multinomial; sharing the
    uniform needs an explicit inverse CDF): the number of cumulative masses at or below u * total."""
    return min(int((probs.cumsum(0) <= u * probs.sum()).sum()), probs.shape[0] - 1)


def released_lantern_chain(drafts, q, target, accept_u, sample_u, nearest, k, delta, lam, zero):
    """A chain through the released sampling walk (evaluate_posterior / evaluate_posterior_v1 on a tree
    with one child per node): accept x when r <= px / qx (qx = 1 for top-k drafts), else sample from the
    rejection's residual; all accepted: sample the bonus token from the last target distribution."""
    kept = []
    for i, x in enumerate(drafts.tolist()):
        gtp = target[i]
        px, fitted = released_relaxed_mass(gtp, x, nearest, k, delta, lam)
        qx = 1.0 if q is None else q[i, x]
        if accept_u[i] <= px / qx:
            kept.append(x)
            continue
        residual = released_rejection(gtp, x, None if q is None else q[i], fitted, nearest, k, zero)
        return len(kept), kept + [pick(residual, float(sample_u))]
    return len(kept), kept + [pick(target[len(kept)], float(sample_u))]


def leaf_paths(parents: list[int]) -> list[list[int]]:
    """Root-to-leaf node paths of a tree, one per leaf, leaves in node order."""
    children = {p for p in parents if p >= 0}
    paths = []
    for leaf in range(len(parents)):
        if leaf in children:
            continue
        path = [leaf]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        paths.append(path)
    return paths


def released_tree_walk(tokens, parents, target, accept_u, sample_u, nearest, k, delta, lam):
    """LANTERN ea_model_llamagen.py EaModel.evaluate_posterior (sampling, top-k drafts of an EAGLE-2 tree):
    candidate rows are root-to-leaf paths sorted by their node indices (cnets_llamagen.py topK_genrate,
    custom_sort, pads last); level by level, the rows agreeing with the accepted prefix are tried in order
    (a token seen at this level is skipped); a rejection turns gtp into its residual for the next sibling.
    The node's own uniform stands for the released ``random.random()`` of that try."""
    paths = sorted(leaf_paths(parents), key=lambda path: path + [len(parents) + 5] * (len(parents) - len(path)))
    depth = max(len(path) for path in paths)
    candidates = [[-2] + [tokens[n] for n in path] + [-1] * (depth - len(path)) for path in paths]
    node_at = [[-1] + path + [None] * (depth - len(path)) for path in paths]
    accept_length, accepted, best = 1, [-2], 0
    adjusted = False
    for i in range(1, depth + 1):
        if i != accept_length:
            break
        adjusted = False
        agreeing = [j for j, row in enumerate(candidates) if row[:accept_length] == accepted]
        gtp = target[node_at[agreeing[0]][i - 1] + 1]
        seen = []
        for j in agreeing:
            x = candidates[j][i]
            if x in seen or x == -1:
                continue
            seen.append(x)
            node = node_at[j][i]
            px, fitted = released_relaxed_mass(gtp, x, nearest, k, delta, lam)
            if accept_u[node] <= px:
                accepted.append(x)
                accept_length += 1
                best = j
                break
            gtp = released_rejection(gtp, x, None, fitted, nearest, k, "target")
            adjusted = True
    if adjusted and accept_length != depth + 1:
        final = gtp
    else:
        final = target[node_at[best][accept_length - 1] + 1]
    path = [node_at[best][i] for i in range(1, accept_length)]
    return accept_length - 1, accepted[1:] + [pick(final, float(sample_u))], path


def released_greedy_tree(tokens, parents, target, nearest, k, delta, lam):
    """LANTERN ea_model_llamagen.py EaModel.evaluate_posterior, greedy branch (logits_processor None) on an
    EAGLE-2 tree: rows are root-to-leaf paths with leaves in node order (cnets_llamagen.py topK_genrate
    sorts them only when sampling); at every row position the relaxed px is found from the TVD of the
    neighbour prefix (tvd = 0.5|px - approx| + cumsum 0.5 p_nearest, the last index within the budget) and
    scattered into gtp; a position is accepted when x is then gtp's argmax; a row keeps its leading
    accepted run, the longest run wins (first such row), and the next token is the argmax after it."""
    paths = leaf_paths(parents)
    lengths = []
    for path in paths:
        length = 0
        for position, node in enumerate(path):
            gtp = target[(path[position - 1] + 1) if position else 0].clone()
            x = tokens[node]
            px = gtp[x]
            nearest_probs = gtp[nearest[x, :k]]
            approx = px + torch.cumsum(nearest_probs, 0)
            tvd = 0.5 * (px - approx).abs() + torch.cumsum(0.5 * nearest_probs, 0)
            budget = (lam - 1) * px if lam is not None else delta
            within = (tvd <= budget).nonzero()
            gtp[x] = approx[within[-1, 0]] if within.numel() else px
            if int(gtp.argmax()) != x:
                break
            length += 1
        lengths.append(length)
    best_length = max(lengths)
    best = lengths.index(best_length)
    path = paths[best][:best_length]
    after = target[path[-1] + 1] if path else target[0]
    return best_length, [tokens[n] for n in path] + [int(after.argmax())], path


def released_gsd_final(p, q, x, group, sq_distances):
    """GSD scheduler/jacobi_iteration_lumina_mgpt.py, SpeculativeSampler.__call__: the acceptance probability
    of draft x. The target's tokens sorted ascending (by logit), x at position c; the window is the slice
    [c - 7 : c + 7] for G = 14 (here [c - G//2 : c + (G-1)//2 + 1]); members within 0.15 of p(x) and at
    squared input-embedding distance below 0.5 (``head_img_sims``) count for both p and q: min(1, P / Q).
    An empty slice (x among the G//2 least probable: a negative start wraps past the end) makes
    ``logit_sort_idx.max()`` raise, and the ``except`` falls back to min(1, p(x) / q(x))."""
    order = torch.sort(p.log()).indices
    c = int((order == x).nonzero()[0, 0])
    window = order[c - group // 2: c + (group - 1) // 2 + 1]
    try:
        mask = ((p[window] - p[x]).abs() < 0.15).to(F64)
        if window.max().item() >= 0 and sq_distances is not None:
            mask = mask * (sq_distances[x][window] < 0.5).to(F64)
        return ((p[window] * mask).sum() / (q[window] * mask).sum()).clamp(max=1)
    except RuntimeError:
        return (p[x] / q[x]).clamp(max=1)


def released_gsd_chain(drafts, q, target, accept_u, sample_u, group, sq_distances):
    """The released GSD decision along a chain: accept when r < :func:`released_gsd_final`; a rejection
    resamples from norm(max(0, p - q)) (SpeculativeSampler.reject_sampling_single_token)."""
    kept = []
    for i, x in enumerate(drafts.tolist()):
        if accept_u[i] < released_gsd_final(target[i], q[i], x, group, sq_distances):
            kept.append(x)
            continue
        return len(kept), kept + [pick((target[i] - q[i]).clamp(min=0), float(sample_u))]
    return len(kept), kept + [pick(target[len(kept)], float(sample_u))]


def released_sq_distances(table: torch.Tensor) -> torch.Tensor:
    """GSD jacobi_iteration_lumina_mgpt.py, _sample: ``head_img_sims`` = |a|^2 + |b|^2 - 2 a.b over the
    language model's input embeddings (``embed_tokens.weight``)."""
    return table.pow(2).sum(-1, keepdim=True) + table.pow(2).sum(-1).unsqueeze(0) - 2 * table @ table.T


# ----------------------------------------------------------------------------------------------------
# Random inputs
# ----------------------------------------------------------------------------------------------------

def fits(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether sampled ``tokens`` fit ``probs`` (chi-square p-value >= P_VALUE_FLOOR; never, if a token of
    probability 0 was sampled)."""
    counts = empirical(tokens, probs.shape[0])
    if (counts[probs == 0] > 0).any():
        return False
    return chi_square_pvalue(counts, probs) >= P_VALUE_FLOOR


def random_dists(gen: torch.Generator, shape: tuple[int, ...], scale: float = 2.5) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=F64) * scale).softmax(-1)


def shared_uniforms(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """The uniforms verify_tokens / verify_tree draw from ``torch.Generator().manual_seed(seed)``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(shape, generator=gen, dtype=F64) for shape in shapes]


def random_tree(gen: torch.Generator, target: torch.Tensor, nodes: int, top: int = 4) -> tuple[list, list]:
    """Parents (a random topological tree) and tokens: each node one of the top tokens of its parent's
    target distribution, distinct among siblings."""
    parents, tokens = [], []
    for node in range(nodes):
        parent = int(torch.randint(-1, node, (1,), generator=gen)) if node else -1
        taken = {tokens[j] for j in range(node) if parents[j] == parent}
        options = [t for t in target[parent + 1].topk(top).indices.tolist() if t not in taken]
        if not options:
            options = [t for t in range(target.shape[-1]) if t not in taken]
        parents.append(parent)
        tokens.append(options[int(torch.randint(len(options), (1,), generator=gen))])
    return parents, tokens


# ----------------------------------------------------------------------------------------------------
# LANTERN
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["zero_target_neighbors", "zero_draft_neighbors"])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("vocab", VOCABS)
def test_lantern_residual_switches_match_the_released_chain_walk(kind, stochastic, vocab):
    """Chains of 1-8 drafts, batch 6, shared uniforms: same accepted counts and tokens as the released
    walk, for delta and lam budgets and k from 1 to V - 1."""
    gen = torch.Generator().manual_seed(vocab * 10 + stochastic)
    nearest = released_neighbor_table(gen, vocab)
    zero = "target" if kind == "zero_target_neighbors" else "draft"
    rejections = 0
    for trial, num_draft in enumerate(range(1, 9)):
        batch = 6
        k = (1, 3, 8, vocab - 1)[trial % 4]
        delta, lam = ((0.05, None), (0.3, None), (0.0, 4.0), (0.0, 20.0))[trial % 4]
        target = random_dists(gen, (batch, num_draft + 1, vocab))
        q = random_dists(gen, (batch, num_draft, vocab), 1.5) if stochastic else None
        drafts = torch.multinomial((q if stochastic else target[:, :num_draft]).reshape(-1, vocab), 1,
                                   generator=gen).reshape(batch, num_draft)
        rule = LanternRule(nearest, k=k, delta=delta, lam=lam, residual_kind=kind)
        seed = 1000 + trial
        result = verify_tokens(drafts, q, target, rule, torch.Generator().manual_seed(seed))
        accept_u, sample_u = shared_uniforms(seed, (batch, num_draft), (batch,))
        for b in range(batch):
            count, tokens = released_lantern_chain(drafts[b], None if q is None else q[b], target[b], accept_u[b],
                                                   sample_u[b], nearest, k, delta, lam, zero)
            assert int(result.num_accepted[b]) == count, (trial, b)
            assert result.tokens[b, : count + 1].tolist() == tokens, (trial, b)
            rejections += count < num_draft
    assert rejections > 10  # the residual was exercised


def _emitted_distribution(rule_args, p, q, draft, nearest, zero):
    """Exact distribution of the first emitted token under the released rule: a draft x (from q, or the
    given token) is kept with probability min(1, relaxed px / qx), else the residual is sampled."""
    k, delta, lam = rule_args
    out = torch.zeros_like(p)
    drafts = [(draft, 1.0)] if q is None else list(enumerate(q.tolist()))
    for x, weight in drafts:
        px, fitted = released_relaxed_mass(p, x, nearest, k, delta, lam)
        qx = 1.0 if q is None else q[x]
        accept = min(1.0, float(px / qx))
        out[x] += weight * accept
        out += weight * (1 - accept) * released_rejection(p, x, q, fitted, nearest, k, zero)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero_target_neighbors", "zero_draft_neighbors"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_lantern_residual_switches_have_the_released_output_distribution(kind, stochastic):
    """10^5 independent one-token verifications against the released rule's exact output distribution
    (chi-square p >= 1e-4); the default TV residual's distribution differs and fails the same test."""
    gen = torch.Generator().manual_seed(7 + stochastic)
    vocab, k, delta, n = 12, 3, 0.3, 100_000
    nearest = released_neighbor_table(gen, vocab)
    p = random_dists(gen, (vocab,), 1.0)
    q = random_dists(gen, (vocab,), 1.0) if stochastic else None
    draft = int(p.argmin()) if q is None else None
    zero = "target" if kind == "zero_target_neighbors" else "draft"
    expected = _emitted_distribution((k, delta, None), p, q, draft, nearest, zero)
    if q is None:
        drafts = torch.full((n, 1), draft)
    else:
        drafts = torch.multinomial(q, n, replacement=True, generator=gen).unsqueeze(1)
    target = p.expand(n, 2, vocab)
    draft_probs = None if q is None else q.expand(n, 1, vocab)
    rule = LanternRule(nearest, k=k, delta=delta, residual_kind=kind)
    emitted = verify_tokens(drafts, draft_probs, target, rule, torch.Generator().manual_seed(3)).tokens[:, 0]
    assert fits(emitted, expected)
    default = verify_tokens(drafts, draft_probs, target, LanternRule(nearest, k=k, delta=delta),
                            torch.Generator().manual_seed(3)).tokens[:, 0]
    assert not fits(default, expected)


def test_lantern_released_residual_falls_back_to_uniform_and_zeroes_only_when_a_neighbour_fitted():
    """The released code's two corner cases, by hand: nothing left after trimming -> uniform (a token of
    probability 0 can then be drawn); no neighbour within the budget -> only x is removed."""
    nearest = torch.tensor([[1, 2, 3], [0, 2, 3], [1, 0, 3], [2, 1, 0]])
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]], dtype=F64)
    rule = LanternRule(nearest, k=1, delta=0.3, residual_kind="zero_target_neighbors")
    # x = 0: neighbour 1 (0.3) fits; x, 1 and 2 are zeroed; token 3 had probability 0: uniform
    assert rule.residual(probs, None, torch.tensor([0])).tolist() == [[1.0, 1.0, 1.0, 1.0]]
    tight = LanternRule(nearest, k=1, delta=0.1, residual_kind="zero_target_neighbors")
    # 0.3 > 0.1: no neighbour fitted, so only x goes
    assert tight.residual(probs, None, torch.tensor([0])).tolist() == [[0.0, 0.3, 0.2, 0.0]]


@pytest.mark.parametrize("vocab", VOCABS)
def test_lantern_sampling_tree_walk_matches_the_released_walk(vocab):
    """Random EAGLE-2 style trees of top-k drafts (up to 12 nodes, batch 4), shared uniforms: the same
    accepted path, tokens and corrected token as the released walk with its trimmed residual."""
    gen = torch.Generator().manual_seed(vocab)
    nearest = released_neighbor_table(gen, vocab)
    k, delta = 4, 0.15
    rule = LanternRule(nearest, k=k, delta=delta, residual_kind="zero_target_neighbors")
    for trial in range(6):
        batch, nodes = 4, 3 + 2 * trial
        target = random_dists(gen, (batch, nodes + 1, vocab))
        built = [random_tree(gen, target[b], nodes) for b in range(batch)]
        tree = DraftTree(torch.tensor([tokens for _, tokens in built]), torch.tensor([parents for parents, _ in built]))
        seed = 50 + trial
        result = verify_tree(tree, target, rule, torch.Generator().manual_seed(seed))
        accept_u, sample_u = shared_uniforms(seed, (batch, nodes), (batch,))
        for b, (parents, tokens) in enumerate(built):
            count, emitted, path = released_tree_walk(tokens, parents, target[b], accept_u[b], sample_u[b],
                                                      nearest, k, delta, None)
            assert int(result.num_accepted[b]) == count
            assert result.tokens[b, : count + 1].tolist() == emitted
            assert result.path[b, :count].tolist() == path


def test_lantern_greedy_longest_path_matches_the_released_greedy_trees():
    """72 random trees (vocabularies 16/37/64, batch 4 per call): tree_path="longest" gives the released
    greedy choice exactly; the default first-accepted walk differs on some of them."""
    differ = 0
    for vocab in VOCABS:
        gen = torch.Generator().manual_seed(100 + vocab)
        nearest = released_neighbor_table(gen, vocab)
        for trial in range(6):
            k, delta, lam = ((6, 0.4, None), (vocab - 1, 0.0, 6.0), (3, 0.25, None))[trial % 3]
            batch, nodes = 4, 4 + 2 * trial
            target = random_dists(gen, (batch, nodes + 1, vocab), 0.8)
            built = [random_tree(gen, target[b], nodes, top=3) for b in range(batch)]
            tree = DraftTree(torch.tensor([t for _, t in built]), torch.tensor([p for p, _ in built]))
            longest = LanternRule(nearest, k=k, delta=delta, lam=lam, greedy=True, tree_path="longest")
            first = LanternRule(nearest, k=k, delta=delta, lam=lam, greedy=True)
            got, walked = verify_tree(tree, target, longest), verify_tree(tree, target, first)
            for b, (parents, tokens) in enumerate(built):
                count, emitted, path = released_greedy_tree(tokens, parents, target[b], nearest, k, delta, lam)
                assert int(got.num_accepted[b]) == count
                assert got.tokens[b, : count + 1].tolist() == emitted
                assert got.path[b, :count].tolist() == path
                differ += walked.tokens[b].tolist() != got.tokens[b].tolist()
    assert differ >= 10  # 30 of the 72 differ


def test_lantern_rule_renames_and_refusals():
    nearest = released_neighbor_table(torch.Generator().manual_seed(0), 10)
    with pytest.raises(ValueError, match=r"now called `residual_kind`.*residual_kind='zero_target_neighbors'"):
        LanternRule(nearest, k=3, residual_mode="official")
    with pytest.raises(ValueError, match="residual_kind='tv'"):
        LanternRule(nearest, k=3, residual_mode="tv")
    with pytest.raises(ValueError, match="ambiguous"):
        LanternRule(nearest, k=3, residual_kind="official")
    with pytest.raises(ValueError, match="tree_path must be one of"):
        LanternRule(nearest, k=3, tree_path="widest")
    with pytest.raises(ValueError, match="needs 4 columns, got 3"):
        LanternRule(nearest[:, :3], k=3, residual_kind="zero_draft_neighbors")
    assert LanternRule(nearest[:, :3], k=3).residual_kind == "tv"


# ----------------------------------------------------------------------------------------------------
# GSD
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("with_distances", [False, True])
def test_gsd_official_window_matches_the_released_sampler(vocab, with_distances):
    """Chains of 1-8 Jacobi drafts, batch 5, shared uniforms, G in {14, 9, 6}: identical decisions and
    tokens, with and without the squared-distance filter in an input-embedding table (threshold 0.5 on
    squared distances = sqrt(0.5) on distances)."""
    gen = torch.Generator().manual_seed(vocab + 1000 * with_distances)
    table = torch.randn(vocab, 8, generator=gen, dtype=F64) * 0.2 if with_distances else None
    sq_distances = released_sq_distances(table) if with_distances else None
    fallbacks = 0
    for trial, num_draft in enumerate(range(1, 9)):
        batch, group = 5, (14, 9, 6)[trial % 3]
        target = random_dists(gen, (batch, num_draft + 1, vocab), 1.2)
        q = random_dists(gen, (batch, num_draft, vocab), 1.2)
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, num_draft)
        rule = GroupedRule(G=group, prob_threshold=0.15, embeddings=table,
                           distance_threshold=math.sqrt(0.5) if with_distances else math.inf, window="official")
        seed = 70 + trial
        result = verify_tokens(drafts, q, target, rule, torch.Generator().manual_seed(seed))
        accept_u, sample_u = shared_uniforms(seed, (batch, num_draft), (batch,))
        for b in range(batch):
            count, tokens = released_gsd_chain(drafts[b], q[b], target[b], accept_u[b], sample_u[b], group,
                                               sq_distances)
            assert int(result.num_accepted[b]) == count, (trial, b)
            assert result.tokens[b, : count + 1].tolist() == tokens, (trial, b)
        ranks_below = (target[:, :num_draft] < target[:, :num_draft].gather(-1, drafts.unsqueeze(-1))).sum(-1)
        fallbacks += int((ranks_below < group // 2).sum())
    assert fallbacks > 0  # the fallback to plain min(1, p/q) was exercised


def test_gsd_official_window_is_the_mirror_image_and_falls_back_near_the_bottom():
    """G = 14 takes 6 more probable and 7 less probable tokens (the symmetric default: 7 and 6); a draft
    with fewer than 7 tokens below it is alone in its group; membership differs in most random draws."""
    probs = torch.linspace(1.0, 2.0, 30, dtype=F64).flip(0).softmax(-1).unsqueeze(0)  # rank = token id
    official = GroupedRule(G=14, prob_threshold=1.0, window="official")
    symmetric = GroupedRule(G=14, prob_threshold=1.0)
    members = official.group_mask(probs, torch.tensor([15]))[0].nonzero().flatten().tolist()
    assert members == list(range(9, 23))  # 6 above (9..14), 7 below (16..22)
    assert symmetric.group_mask(probs, torch.tensor([15]))[0].nonzero().flatten().tolist() == list(range(8, 22))
    assert official.group_mask(probs, torch.tensor([23]))[0].nonzero().flatten().tolist() == [23]  # 6 below
    assert official.group_mask(probs, torch.tensor([22]))[0].sum() == 14  # 7 below: a full window
    assert official.group_mask(probs, torch.tensor([2]))[0].nonzero().flatten().tolist() == list(range(0, 10))
    gen = torch.Generator().manual_seed(5)
    target = random_dists(gen, (300, 64), 1.0)
    tokens = torch.multinomial(target, 1, generator=gen).squeeze(1)
    differs = (GroupedRule(G=14, window="official").group_mask(target, tokens)
               != GroupedRule(G=14).group_mask(target, tokens)).any(-1)
    assert int(differs.sum()) > 150


@pytest.mark.slow
def test_gsd_official_window_has_the_released_output_distribution():
    """10^5 independent one-token verifications (G = 14, V = 24) against the released rule's exact
    distribution of the emitted token; the symmetric window's distribution fails the same test."""
    gen = torch.Generator().manual_seed(11)
    vocab, n, group = 24, 100_000, 14
    p = random_dists(gen, (vocab,), 0.6)
    q = random_dists(gen, (vocab,), 1.5)
    expected = torch.zeros(vocab, dtype=F64)
    residual = (p - q).clamp(min=0)
    for x in range(vocab):  # draft x ~ q, kept with the released probability, else the residual is drawn
        accept = float(released_gsd_final(p, q, x, group, None))
        expected[x] += q[x] * accept
        expected += q[x] * (1 - accept) * residual / residual.sum()
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).unsqueeze(1)
    args = (drafts, q.expand(n, 1, vocab), p.expand(n, 2, vocab))
    official = verify_tokens(*args, GroupedRule(G=group, window="official"), torch.Generator().manual_seed(2))
    assert fits(official.tokens[:, 0], expected)
    symmetric = verify_tokens(*args, GroupedRule(G=group), torch.Generator().manual_seed(2))
    assert not fits(symmetric.tokens[:, 0], expected)


# ----------------------------------------------------------------------------------------------------
# Method configs: the switches reach the rules, and the distance filter's table is resolved
# ----------------------------------------------------------------------------------------------------

def test_configs_pass_the_switches_to_their_rules_and_resolve_the_embedding_table():
    pipe = tiny_shapes_pipeline()
    vocab = int(pipe.transformer.config.vocab_size)
    sampled, greedy = BuildRequest(SamplingConfig()), BuildRequest(SamplingConfig(do_sample=False))
    default = LanternConfig(k=8).build(pipe, sampled).rule
    assert (default.residual_kind, default.tree_path, default.neighbors.shape[1]) == ("tv", "first_accepted", 8)
    switched = LanternConfig(k=8, residual_kind="zero_draft_neighbors", tree_path="longest").build(pipe, greedy).rule
    assert (switched.residual_kind, switched.tree_path, switched.neighbors.shape[1]) == \
        ("zero_draft_neighbors", "longest", 9)  # the released residual trims k + 1 neighbours
    assert GSDConfig().build(pipe, sampled).rule.embeddings is None  # no distance filter, no table
    released = GSDConfig(group_size=14, group_window="official", distance_space="input_embeddings",
                         distance_threshold=math.sqrt(0.5)).build(pipe, sampled).rule
    assert released.window == "official" and released.G == 14
    assert torch.equal(released.embeddings, pipe.transformer.get_input_embeddings().weight)
    codebook = GSDConfig(distance_threshold=1.0).build(pipe, sampled).rule
    assert torch.equal(codebook.embeddings, pipe.codebook_embeddings())
    assert codebook.embeddings.shape[0] == released.embeddings.shape[0] == vocab
    for field, value in (("residual_kind", "official"), ("tree_path", "deepest"), ("group_window", "left"),
                         ("distance_space", "pixels")):
        config_class = GSDConfig if field in ("group_window", "distance_space") else LanternConfig
        with pytest.raises(ValueError, match=f"{config_class.__name__}.{field} must be one of"):
            config_class(**{field: value})
    no_embeddings = SimpleNamespace(transformer=SimpleNamespace(config=SimpleNamespace(vocab_size=vocab)))
    with pytest.raises(ValueError, match="get_input_embeddings"):
        GSDConfig(distance_space="input_embeddings", distance_threshold=1.0).distance_embeddings(no_embeddings)
