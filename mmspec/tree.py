"""Draft trees: layout, attention masks, EAGLE-1 static, EAGLE-2 dynamic and entropy-adaptive construction,
verification.

A :class:`DraftTree` holds N drafted nodes per row in topological order (a parent comes before its
children, siblings in the order they should be tried). The *root* is the last committed token, which is
not part of the tree; the target scores ``[root, node_0, ..., node_{N-1}]`` in one forward with the
mask of :func:`tree_attention_mask`, giving ``target_probs [B, N+1, V]`` where index 0 is the target's
distribution after the root and index j+1 the distribution after node j.

Verification walks from the root: among the children of the current node it tries siblings in order;
a rejected sibling turns the target distribution into the rule's residual before the next sibling is
tried (multi-candidate speculative sampling, SpecInfer / EAGLE), which keeps :class:`ExactRule`
lossless both for deterministic top-k siblings (residual = p with the rejected token zeroed) and for
siblings drawn from q (residual = norm(max(0, p - q))).

A NaN, infinite, negative or all-zero row of the target or draft distributions raises
:class:`~mmspec.validation.NonFiniteProbabilitiesError` naming it and the row, as in :mod:`mmspec.verify`:
at the entry while value checks are on, else when the final token would be drawn from it (a NaN row rejects
every sibling, so it reaches the draw).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mmspec.rules import AcceptanceRule, ExactRule
from mmspec.sampling import draw, draw_uniforms
from mmspec.validation import (
    NonFiniteProbabilitiesError,
    blame_inputs,
    check_ndim,
    check_positive_int,
    check_probs,
    check_token_ids,
    value_checks,
)

#: How errors name the distributions of a tree.
TARGET_NAME, DRAFT_NAME = "target distribution (target_probs)", "draft distribution (tree.draft_probs)"

ROOT = -1  # parent index of the root's children


@dataclass
class DraftTree:
    """Drafted tree per row.

    Attributes:
        tokens: LongTensor ``[B, N]``.
        parents: LongTensor ``[B, N]``; ``-1`` for children of the root, else an index < the node's own.
        draft_probs: ``[B, N, V]`` the draft distribution each node was drawn from (at its parent), or
            None for deterministic drafts (top-k expansion).
        without_replacement: the siblings of each parent were drawn one after another *without replacement*
            from their shared ``draft_probs`` (:func:`~mmspec.sampling.sample_without_replacement`, as
            SJD-PAC's proactive trees draw them): verification then tests the k-th sibling against its own
            law, ``draft_probs`` with the earlier siblings' tokens removed and renormalised, and skips a
            sibling that repeats an earlier one (what a sampler returns once the support is exhausted).
            With it False, siblings are independent draws from their ``draft_probs``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    without_replacement: bool = False

    def __post_init__(self) -> None:
        check_ndim(self.tokens, 2, "tree.tokens", "[B, N]")
        if self.parents.shape != self.tokens.shape:
            raise ValueError(f"tree.parents must match tree.tokens {tuple(self.tokens.shape)}, "
                             f"got {tuple(self.parents.shape)}")
        if self.tokens.shape[1] == 0:
            raise ValueError("a draft tree needs at least one node")
        index = torch.arange(self.tokens.shape[1], device=self.parents.device)
        if ((self.parents >= index) | (self.parents < ROOT)).any():
            raise ValueError("tree.parents must be topologically ordered: -1 or an index smaller than the node's")

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def depths(self) -> torch.Tensor:
        """Depth of each node ``[B, N]`` (children of the root have depth 1)."""
        return tree_depths(self.parents)


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` depths from parent indices (``-1``: a child of the root, depth 1).

    Pointer jumping: every node keeps a pointer ``up`` to an ancestor and the number of edges to it;
    each pass adds the pointed-to node's count and doubles the jump, so a tree of depth D takes about
    log2(D) vectorised passes instead of a Python step per node (this runs in every tree round)."""
    depths = torch.ones_like(parents)
    up = parents.clone()
    while True:
        above = up >= 0
        if not bool(above.any()):
            return depths
        safe = up.clamp_min(0)
        depths = torch.where(above, depths + depths.gather(1, safe), depths)
        up = torch.where(above, up.gather(1, safe), up)


def tree_attention_mask(parents: torch.Tensor, include_root: bool = True) -> torch.Tensor:
    """Boolean ancestor-or-self mask: ``mask[b, i, j]`` is True iff node j is i or an ancestor of i.

    With ``include_root`` the root (the last committed token) is prepended as index 0, visible to all:
    the result is ``[B, N+1, N+1]``, matching the target's input ``[root, nodes...]``. Built by walking
    all nodes up one level per pass (as many passes as the tree is deep, not one per node).
    """
    batch, num_nodes = parents.shape
    mask = torch.eye(num_nodes, dtype=torch.bool, device=parents.device).expand(batch, -1, -1).clone()
    rows = torch.arange(batch, device=parents.device).unsqueeze(1).expand(-1, num_nodes)
    nodes = torch.arange(num_nodes, device=parents.device).expand(batch, -1)
    ancestor = parents.clone()  # [B, N]: each node's ancestor at the current distance (-1 above the root)
    while True:
        above = ancestor >= 0
        if not bool(above.any()):
            break
        mask[rows[above], nodes[above], ancestor[above]] = True
        ancestor = torch.where(above, parents.gather(1, ancestor.clamp_min(0)), ancestor)
    if not include_root:
        return mask
    full = torch.ones(batch, num_nodes + 1, num_nodes + 1, dtype=torch.bool, device=parents.device)
    full[:, 0, 1:] = False
    full[:, 1:, 1:] = mask
    return full


def tree_position_offsets(parents: torch.Tensor) -> torch.Tensor:
    """Position offsets of ``[root, nodes...]`` relative to the root: ``[B, N+1]`` (root 0, node depth)."""
    return torch.cat([torch.zeros_like(parents[:, :1]), tree_depths(parents)], dim=1)


# ----------------------------------------------------------------------------------------------------
# Construction
# ----------------------------------------------------------------------------------------------------

def static_tree_from_choices(choices: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-1 / Medusa static tree from a list of paths of top-k ranks, e.g. ``[[0], [1], [0, 0]]``.

    Returns ``(parents [N], ranks [N])`` in topological order (by depth, then as listed): node j is the
    ``ranks[j]``-th most likely draft token at its parent. Every prefix of a path must be listed too.
    """
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    if not paths or any(len(p) == 0 for p in paths):
        raise ValueError("choices must be a non-empty list of non-empty paths of ranks")
    index = {path: j for j, path in enumerate(paths)}
    parents, ranks = [], []
    for path in paths:
        if any(r < 0 for r in path):
            raise ValueError(f"ranks in choices must be >= 0, got {list(path)}")
        if len(path) > 1 and path[:-1] not in index:
            raise ValueError(f"choices lists {list(path)} but not its parent {list(path[:-1])}")
        parents.append(index[path[:-1]] if len(path) > 1 else ROOT)
        ranks.append(path[-1])
    return torch.tensor(parents), torch.tensor(ranks)


StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def expand_dynamic_tree(root_log_probs: torch.Tensor, step_fn: StepFn, depth: int, top_k: int,
                        total_tokens: int) -> DraftTree:
    """EAGLE-2 dynamic draft tree (arXiv 2406.16858) built by repeatedly calling the drafter.

    Each level keeps the ``top_k`` highest-scoring nodes (score = cumulative draft log-probability),
    expands each into its ``top_k`` most likely children, and finally the ``total_tokens`` best nodes of
    all levels form the tree (the set is ancestor-closed because a child never scores above its parent).

    Args:
        root_log_probs: ``[B, V]`` draft log-probabilities after the root token.
        step_fn: ``step_fn(tokens [B, F], node_ids [B, F], parent_ids [B, F], depth) -> log_probs
            [B, F, V]`` runs the drafter on the frontier nodes (ids number this function's candidates,
            ``parent_ids`` is -1 for the root's children; every ancestor of a frontier node was itself
            fed in an earlier call, see :class:`TreeAttentionBuilder`) and returns the log-probabilities
            of their children. The drafter keeps its own cache of fed nodes.
        depth: maximum tree depth (>= 1); top_k: branching; total_tokens: nodes kept.
    Returns:
        A deterministic :class:`DraftTree` (``draft_probs=None``), siblings ordered by score.
    """
    _check_expansion(depth, top_k, total_tokens)
    pool = _CandidatePool(root_log_probs, top_k)
    frontier = pool.level_ids[:, :top_k]  # the root's top_k children are all the first level
    for level in range(2, depth + 1):
        pool.add_children(step_fn(*pool.feed(frontier), level - 1), frontier)
        frontier = pool.best_of_last_level(top_k)
    return pool.select(total_tokens)


def expand_entropy_tree(root_log_probs: torch.Tensor, step_fn: StepFn, depth: int, top_k: int,
                        total_tokens: int, max_depth: int | None = None) -> DraftTree:
    """Entropy-adaptive draft tree: deep and narrow where the drafter is confident, shallow and wide where
    it is not (the idea of SAGE, arXiv 2602.00523, applied per node of an EAGLE-2 expansion).

    Every expanded node offers its ``top_k`` most likely children as candidates, as in
    :func:`expand_dynamic_tree`, but how many of them are expanded further depends on the drafter's entropy
    H at that node: :func:`entropy_branching` (``exp(H)``, the distribution's effective number of choices,
    rounded up, at most ``top_k``); at most ``top_k`` nodes are expanded per level. A node is expanded only
    while it scores above the ``total_tokens``-th best candidate so far, since no descendant of it could be
    kept otherwise; when no row has such a node the expansion stops (the tree stays shallow where the
    drafter is unsure). Past ``depth`` levels the tree grows on where the drafter is sure (``exp(H)``
    rounds to 1, :func:`is_sure`): each row's best path continues with one node per level while every
    step on it is sure, up to ``max_depth`` levels (deep and narrow). The tree is the ``total_tokens`` best
    candidates, EAGLE-2's node budget and selection, so verification (and losslessness) is unchanged.

    Args and return value as :func:`expand_dynamic_tree`; ``depth`` is the depth every row may reach,
    deeper levels, up to ``max_depth`` (default and at most ``total_tokens``), only follow sure paths. Rows
    of a batch share each level's frontier width (the widest row's); a row that wants fewer nodes fills its
    slots with its next best candidates.
    """
    _check_expansion(depth, top_k, total_tokens)
    if max_depth is not None:
        check_positive_int(max_depth, "max_depth")
    max_depth = total_tokens if max_depth is None else min(max_depth, total_tokens)
    pool = _CandidatePool(root_log_probs, top_k)
    branching = entropy_branching(root_log_probs, top_k).unsqueeze(1)  # [B, 1]: for the root
    sure = is_sure(root_log_probs).unsqueeze(1)
    for level in range(2, max(depth, max_depth) + 1):
        # a candidate is wanted when it is among the first `branching` children of its parent and could still
        # have a descendant in the tree; past `depth`, only the top child of a sure parent, one per row
        parent_branching, parent_sure = branching.gather(1, pool.level_slots), sure.gather(1, pool.level_slots)
        wanted = pool.level_scores > pool.kth_best_score(total_tokens).unsqueeze(1)
        if level <= depth:
            wanted &= pool.level_ranks < parent_branching
        else:
            wanted &= (pool.level_ranks == 0) & parent_sure
            wanted &= pool.level_scores >= torch.where(wanted, pool.level_scores, -torch.inf).amax(1, keepdim=True)
        width = min(top_k, int(wanted.sum(1).max()))
        if width == 0:
            break
        frontier = pool.best_of_last_level(width, prefer=wanted)
        log_probs = step_fn(*pool.feed(frontier), level - 1)
        branching, sure = entropy_branching(log_probs, top_k), is_sure(log_probs)  # [B, width]
        pool.add_children(log_probs, frontier)
    return pool.select(total_tokens)


def _effective_choices(log_probs: torch.Tensor) -> torch.Tensor:
    """``exp(H)`` of the distributions ``log_probs [..., V]``: the number of equally likely tokens with the same
    entropy (1 for a sure drafter, 2 for a coin flip between two tokens, V for a uniform distribution)."""
    return torch.special.entr(log_probs.float().exp()).sum(-1).exp()


def entropy_branching(log_probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """How many children of a node an entropy-adaptive tree expands: ``exp(H)`` rounded up and clamped to
    ``[1, top_k]``, H the entropy (nats) of the drafter's distribution ``log_probs [..., V]`` there. A tenth
    of a choice is ignored, so rounding error and a negligible tail add no branch. Returns a LongTensor
    ``[...]``."""
    return (_effective_choices(log_probs) - 0.1).ceil().clamp(1, top_k).long()


def is_sure(log_probs: torch.Tensor) -> torch.Tensor:
    """Whether the drafter is sure at a node: ``exp(H)`` below 1.5 (it rounds to one choice), e.g. a 95%
    favourite; a BoolTensor ``[...]``. An entropy-adaptive tree grows past its depth only along sure nodes."""
    return _effective_choices(log_probs) < 1.5


def _check_expansion(depth: int, top_k: int, total_tokens: int) -> None:
    for value, name in ((depth, "depth"), (top_k, "top_k"), (total_tokens, "total_tokens")):
        check_positive_int(value, name)


class _CandidatePool:
    """The candidates of a tree expansion, numbered in order of creation (the ids the drafter is fed).

    Level by level, every expanded (frontier) node adds its ``top_k`` most likely children with their
    cumulative scores; :meth:`select` keeps the best ``total_tokens`` as a :class:`DraftTree`.
    """

    def __init__(self, root_log_probs: torch.Tensor, top_k: int) -> None:
        self.top_k = top_k
        scores, tokens = root_log_probs.topk(top_k, dim=-1)  # [B, k]
        self.tokens, self.scores, self.parents = [tokens], [scores], [torch.full_like(tokens, ROOT)]
        self._add_level(scores, torch.zeros_like(tokens), torch.arange(top_k, device=tokens.device).expand_as(tokens))

    def _add_level(self, scores: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor) -> None:
        """Record the newest level: its scores, each candidate's parent slot in the frontier and rank."""
        offset = sum(t.shape[1] for t in self.tokens[:-1])
        self.level_scores, self.level_slots, self.level_ranks = scores, slots, ranks
        self.level_ids = torch.arange(offset, offset + scores.shape[1], device=scores.device).expand_as(scores)

    def feed(self, frontier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens, node ids, parent ids)`` of ``frontier`` (candidate ids ``[B, F]``) for the step function."""
        tokens, parents = torch.cat(self.tokens, 1), torch.cat(self.parents, 1)
        return tokens.gather(1, frontier), frontier, parents.gather(1, frontier)

    def add_children(self, log_probs: torch.Tensor, frontier: torch.Tensor) -> None:
        """Add the ``top_k`` best children of each frontier node (``log_probs [B, F, V]`` after them)."""
        batch, width = frontier.shape
        parent_scores = torch.cat(self.scores, 1).gather(1, frontier)
        child_scores, child_tokens = log_probs.topk(self.top_k, dim=-1)  # [B, F, k]
        child_scores = child_scores + parent_scores.unsqueeze(-1)
        parents = frontier.unsqueeze(-1).expand(-1, -1, self.top_k)
        slots = torch.arange(width, device=frontier.device).view(1, -1, 1).expand_as(parents)
        ranks = torch.arange(self.top_k, device=frontier.device).expand_as(parents)
        flat = [t.reshape(batch, -1) for t in (child_scores, child_tokens, parents, slots, ranks)]
        self.scores.append(flat[0])
        self.tokens.append(flat[1])
        self.parents.append(flat[2])
        self._add_level(flat[0], flat[3], flat[4])

    def best_of_last_level(self, width: int, prefer: torch.Tensor | None = None) -> torch.Tensor:
        """Ids ``[B, width]`` of the newest level's best-scoring candidates (those in ``prefer`` first)."""
        if prefer is None:
            return self.level_ids.gather(1, self.level_scores.topk(width, dim=-1).indices)
        order = self.level_scores.argsort(dim=-1, descending=True, stable=True)  # by score, then preferred first
        order = order.gather(1, prefer.gather(1, order).long().argsort(dim=-1, descending=True, stable=True))
        return self.level_ids.gather(1, order[:, :width])

    def kth_best_score(self, k: int) -> torch.Tensor:
        """``[B]`` the k-th best score of all candidates (-inf while there are fewer than k)."""
        scores = torch.cat(self.scores, 1)
        if scores.shape[1] < k:
            return scores.new_full(scores.shape[:1], -torch.inf)
        return scores.topk(k, dim=-1).values[:, -1]

    def select(self, total_tokens: int) -> DraftTree:
        return _select_tree(torch.cat(self.tokens, 1), torch.cat(self.scores, 1), torch.cat(self.parents, 1),
                            total_tokens)


class TreeAttentionBuilder:
    """Attention masks for a drafter that feeds a draft tree level by level into its own cache.

    Each fed node may attend to the slots of its ancestors and itself (plus everything before the tree,
    which the caller prepends). Nodes are identified by the candidate ids of :func:`expand_dynamic_tree`.
    """

    def __init__(self, batch: int, device: torch.device | str = "cpu") -> None:
        self.batch, self.device = batch, device
        self._ids = torch.empty(batch, 0, dtype=torch.long, device=device)   # fed candidate id per slot
        self._anc = torch.empty(batch, 0, 0, dtype=torch.bool, device=device)  # [B, fed, fed]

    def frontier_inputs(self, node_ids: torch.Tensor, parent_ids: torch.Tensor, depth: int,
                        slots_before_tree: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Register frontier nodes ``[B, F]`` at ``depth`` and return what a runner forward needs:
        position offsets ``[B, F]`` (the pending token's position + depth) and the key visibility
        ``[B, F, slots_before_tree + fed + F]`` (every slot before the tree, then ancestors and self)."""
        visible = self.feed(node_ids, parent_ids)
        before = torch.ones(*node_ids.shape, slots_before_tree, dtype=torch.bool, device=node_ids.device)
        return torch.full_like(node_ids, depth - 1), torch.cat([before, visible], 2)

    @property
    def num_fed(self) -> int:
        return self._ids.shape[1]

    def feed(self, node_ids: torch.Tensor, parent_ids: torch.Tensor) -> torch.Tensor:
        """Register frontier nodes ``[B, F]`` and return their visibility over all tree slots
        ``[B, F, fed + F]`` (ancestors and self)."""
        batch, frontier = node_ids.shape
        fed = self.num_fed
        # slot of each parent among the fed nodes (-1 for root children)
        match = (self._ids.unsqueeze(1) == parent_ids.unsqueeze(-1)) & (parent_ids.unsqueeze(-1) >= 0)  # [B, F, fed]
        if ((parent_ids >= 0) & ~match.any(-1)).any():
            raise ValueError("a frontier node's parent was never fed to the drafter")
        if fed:
            parent_slot = match.float().argmax(-1)  # [B, F]
            inherited = self._anc.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, fed))
            inherited = inherited & match.any(-1, keepdim=True)
        else:
            inherited = torch.zeros(batch, frontier, 0, dtype=torch.bool, device=node_ids.device)
        visible = torch.cat([inherited, torch.eye(frontier, dtype=torch.bool, device=node_ids.device)
                             .expand(batch, -1, -1)], dim=2)  # [B, F, fed + F]
        grown = torch.zeros(batch, fed + frontier, fed + frontier, dtype=torch.bool, device=node_ids.device)
        grown[:, :fed, :fed] = self._anc
        grown[:, fed:, :] = visible
        self._anc, self._ids = grown, torch.cat([self._ids, node_ids], dim=1)
        return visible


def _select_tree(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor,
                 total_tokens: int) -> DraftTree:
    """Keep the best ``total_tokens`` candidates and renumber them topologically."""
    batch, num_candidates = tokens.shape
    keep = min(total_tokens, num_candidates)
    depth = tree_depths(parents)
    # Rank by score, ties towards shallower nodes, so the kept set stays ancestor-closed: a sure child's score
    # can equal its parent's in floating point (and -inf ties -inf). Two stable sorts order lexicographically.
    by_depth = depth.argsort(dim=-1, stable=True)
    ranked = by_depth.gather(1, scores.gather(1, by_depth).argsort(dim=-1, descending=True, stable=True))
    chosen = ranked[:, :keep]  # [B, keep], best first
    # Topological order: by depth, then by score (siblings tried best-first).
    chosen = chosen.gather(1, depth.gather(1, chosen).argsort(dim=-1, stable=True))
    new_index = torch.full((batch, num_candidates), ROOT, dtype=torch.long, device=tokens.device)
    new_index.scatter_(1, chosen, torch.arange(keep, device=tokens.device).expand(batch, -1).contiguous())
    old_parents = parents.gather(1, chosen)
    new_parents = torch.where(old_parents < 0, ROOT, new_index.gather(1, old_parents.clamp_min(0)))
    if ((old_parents >= 0) & (new_parents < 0)).any():
        raise RuntimeError("internal error: selected draft tree is not ancestor-closed")
    return DraftTree(tokens.gather(1, chosen), new_parents)


# ----------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------

@dataclass
class TreeVerification:
    """Result of verifying a draft tree.

    Attributes:
        num_accepted: LongTensor ``[B]``, accepted nodes on the chosen path.
        tokens: LongTensor ``[B, D+1]`` (D = tree depth): accepted path tokens, then one corrected or
            bonus token, ``-1`` padding (same layout as ``Verification.tokens``).
        path: LongTensor ``[B, D]``: node indices of the accepted path, ``-1`` padding. The caller keeps
            the target's cache entries of ``[root] + path`` (input indices ``0`` and ``path + 1``).
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor
    path: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1


def verify_tree(tree: DraftTree, target_probs: torch.Tensor, rule: AcceptanceRule = ExactRule(),
                generator: torch.Generator | None = None) -> TreeVerification:
    """Verify a draft tree against ``target_probs [B, N+1, V]`` and return the best accepted path.

    Uniforms: ``[B, N]`` (one per node, used when that node is tried), then ``[B]`` for the final draw.
    A greedy rule with ``tree_path="longest"`` keeps the longest accepted path instead of walking siblings
    in order (:attr:`~mmspec.rules.AcceptanceRule.tree_path`).
    """
    if not isinstance(rule, AcceptanceRule):
        raise ValueError(f"rule must be an AcceptanceRule, got {rule!r}")
    batch, num_nodes = tree.tokens.shape
    check_ndim(target_probs, 3, "target_probs", "[B, N+1, V]")
    if target_probs.shape[:2] != (batch, num_nodes + 1):
        raise ValueError(f"target_probs must have shape [B, N+1, V] = [{batch}, {num_nodes + 1}, V], "
                         f"got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[-1]
    check_probs(target_probs, TARGET_NAME)
    if tree.draft_probs is not None:
        if tree.draft_probs.shape != (batch, num_nodes, vocab):
            raise ValueError(f"tree.draft_probs must have shape [B, N, V] = [{batch}, {num_nodes}, {vocab}], "
                             f"got {tuple(tree.draft_probs.shape)}")
        check_probs(tree.draft_probs, DRAFT_NAME)
    check_token_ids(tree.tokens, vocab, "tree.tokens")
    rule.check_vocab(vocab)

    accept_u = draw_uniforms((batch, num_nodes), target_probs, generator)
    sample_u = draw_uniforms((batch,), target_probs, generator)
    walk = _longest_path if rule.greedy and rule.tree_path == "longest" else _walk
    with value_checks(False):  # checked above: the rule need not scan the rows at every sibling
        if tree.without_replacement:
            laws, repeated = sibling_laws_without_replacement(tree)
            num_accepted, path, current = _walk(DraftTree(tree.tokens, tree.parents, laws), target_probs, rule,
                                                accept_u, skip=repeated)
        else:
            num_accepted, path, current = walk(tree, target_probs, rule, accept_u)
    try:
        next_tokens = draw(current, rule.greedy, uniforms=sample_u, name="residual")
    except NonFiniteProbabilitiesError as error:  # name the distribution the bad row came from
        raise blame_inputs(error, (TARGET_NAME, target_probs), (DRAFT_NAME, tree.draft_probs)) from None
    rows = torch.arange(batch, device=tree.tokens.device)
    tokens = torch.where(path >= 0, tree.tokens.gather(1, path.clamp_min(0)), -1)
    tokens = torch.cat([tokens, tokens.new_full((batch, 1), -1)], 1)
    tokens[rows, num_accepted] = next_tokens
    return TreeVerification(num_accepted, tokens, path)


def children_table(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N+1, C]``: the children of the root (row 0) and of node j (row j+1) in sibling order,
    ``-1`` padded (C = the largest number of siblings)."""
    batch, num_nodes = parents.shape
    slot = parents + 1  # [B, N] row of the parent in the table
    # rank of each node among its siblings = number of earlier nodes with the same parent
    same = (slot.unsqueeze(2) == slot.unsqueeze(1)) & torch.ones(num_nodes, num_nodes, dtype=torch.bool,
                                                                 device=parents.device).tril(-1)
    rank = same.sum(-1)  # [B, N]
    width = int(rank.max()) + 1
    table = torch.full((batch, num_nodes + 1, width), -1, dtype=torch.long, device=parents.device)
    rows = torch.arange(batch, device=parents.device).unsqueeze(1).expand(-1, num_nodes)
    nodes = torch.arange(num_nodes, device=parents.device).expand(batch, -1)
    table[rows, slot, rank] = nodes
    return table


def sibling_laws_without_replacement(tree: DraftTree) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The law each node of a ``without_replacement`` tree was drawn from given its earlier siblings:
    ``(laws [B, N, V], repeated [B, N])``.

    Node n's law is its ``draft_probs`` with the tokens of the siblings before it (same parent, smaller
    index) zeroed and renormalised: successive sampling without replacement draws the k-th sibling from it.
    ``repeated`` marks siblings whose token an earlier sibling already holds (an exhausted support, or
    deterministic duplicates); verification skips them, so their law (zero mass, left unnormalised) is
    never read. Multi-draft speculative sampling with these laws (recursive rejection sampling: test sibling
    k against the residual left by siblings 0..k-1, with q_k its own law) outputs the target exactly.
    """
    batch, num_nodes = tree.tokens.shape
    earlier = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=tree.tokens.device).tril(-1)
    siblings = (tree.parents.unsqueeze(2) == tree.parents.unsqueeze(1)) & earlier  # [B, N(node), N(before)]
    same_token = tree.tokens.unsqueeze(2) == tree.tokens.unsqueeze(1)
    repeated = (siblings & same_token).any(-1)
    if tree.draft_probs is None:  # point masses: a repeated sibling is skipped, the others are unchanged
        return None, repeated
    vocab = tree.draft_probs.shape[-1]
    # zero each node's law at its earlier siblings' tokens: one scatter into a spare column V for the others
    earlier_tokens = torch.where(siblings, tree.tokens.unsqueeze(1).expand(-1, num_nodes, -1), vocab)  # [B, N, N]
    laws = torch.nn.functional.pad(tree.draft_probs, (0, 1)).scatter_(-1, earlier_tokens, 0.0)[..., :vocab]
    total = laws.sum(-1, keepdim=True)
    return torch.where(total > 0, laws / total.clamp_min(torch.finfo(laws.dtype).tiny), laws), repeated


def _walk(tree: DraftTree, target_probs: torch.Tensor, rule: AcceptanceRule, accept_u: torch.Tensor,
          skip: torch.Tensor | None = None):
    """Vectorised walk from the root over all rows at once.

    At each depth, every row tries the children of its current node in sibling order; a rejected
    sibling turns the row's distribution into the rule's (normalised) residual. Nodes marked in ``skip``
    ``[B, N]`` are never tried (repeated siblings of a tree drawn without replacement). Returns
    ``(num_accepted [B], path [B, D], final distribution [B, V])``.
    """
    batch, num_nodes = tree.tokens.shape
    rows = torch.arange(batch, device=tree.tokens.device)
    table = children_table(tree.parents)
    max_depth = int(tree.depths().max())
    path = torch.full((batch, max_depth), -1, dtype=torch.long, device=tree.tokens.device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=tree.tokens.device)
    node = torch.full((batch,), ROOT, dtype=torch.long, device=tree.tokens.device)
    current = target_probs[:, 0]
    walking = torch.ones(batch, dtype=torch.bool, device=tree.tokens.device)
    for depth in range(max_depth):
        moved = torch.zeros_like(walking)
        for sibling in range(table.shape[2]):
            child = table[rows, node + 1, sibling]  # [B]
            trying = walking & ~moved & (child >= 0)
            if not trying.any():
                break
            safe = child.clamp_min(0)
            if skip is not None:
                trying = trying & ~skip[rows, safe]
            token = tree.tokens[rows, safe]
            q = None if tree.draft_probs is None else tree.draft_probs[rows, safe]
            depths = torch.tensor(depth + 1) if rule.uses_depths else None
            target_mass, draft_mass = rule.masses_at(current, q, token, depths)
            accept = trying & (accept_u[rows, safe] * draft_mass < target_mass)
            reject = trying & ~accept
            if bool(reject.any()):  # the residual over the vocabulary only when some row needs it
                residual = rule.residual(current, q, token)
                residual = residual / residual.sum(-1, keepdim=True)
                current = torch.where(reject.unsqueeze(-1), residual, current)
            current = torch.where(accept.unsqueeze(-1), target_probs[rows, safe + 1], current)
            node = torch.where(accept, child, node)
            path[:, depth] = torch.where(accept, child, path[:, depth])
            moved |= accept
        num_accepted += moved.long()
        walking &= moved
        if not walking.any():
            break
    return num_accepted, path, current


def _longest_path(tree: DraftTree, target_probs: torch.Tensor, rule: AcceptanceRule, accept_u: torch.Tensor):
    """Greedy rules with ``tree_path="longest"``: the longest root path whose every node the rule accepts.

    Each node is judged against its parent's target distribution (a greedy rule's residual is the target
    itself, so a rejected sibling changes nothing for the next). Every leaf's path counts its leading
    accepted nodes, and the first leaf in node order with the most wins, as the released LANTERN code
    scores its candidate paths. Returns what :func:`_walk` returns.
    """
    batch, num_nodes = tree.tokens.shape
    device = tree.tokens.device
    rows = torch.arange(batch, device=device)
    at_parent = target_probs[rows.unsqueeze(1), tree.parents + 1]  # [B, N, V]
    depths = tree.depths() if rule.uses_depths else None
    target_mass, draft_mass = rule.masses_at(at_parent, tree.draft_probs, tree.tokens, depths)
    accepted = accept_u * draft_mass < target_mass  # [B, N]
    lineage = tree_attention_mask(tree.parents, include_root=False)  # [B, N, N]: ancestor-or-self
    reached = ~(lineage & ~accepted.unsqueeze(1)).any(-1)  # the node and all its ancestors accepted
    depths = tree.depths()
    nodes = torch.arange(num_nodes, device=device)
    is_leaf = ~(tree.parents.unsqueeze(-1) == nodes).any(1)  # [B, N]
    # each leaf's accepted length: the depth of its deepest reached ancestor-or-self (0: none)
    reached_depth = torch.where(lineage & reached.unsqueeze(1), depths.unsqueeze(1), 0)  # [B, N(leaf), N]
    lengths = torch.where(is_leaf, reached_depth.amax(-1), -1)
    best_leaf = lengths.argmax(-1)  # the first leaf with the longest accepted path
    num_accepted = lengths.gather(1, best_leaf.unsqueeze(1)).squeeze(1)
    on_path = lineage[rows, best_leaf] & reached[rows]  # [B, N]: the accepted nodes of that leaf's path
    path_depth = torch.where(on_path, depths, 0)
    max_depth = int(depths.max())
    slots = torch.arange(1, max_depth + 1, device=device)
    hit = path_depth.unsqueeze(1) == slots.view(1, -1, 1)  # [B, D, N]
    path = torch.where(hit.any(-1), hit.long().argmax(-1), -1)
    last = torch.where(num_accepted > 0, path.gather(1, (num_accepted - 1).clamp_min(0).unsqueeze(1)).squeeze(1), -1)
    current = target_probs[rows, last + 1]
    return num_accepted, path, current
