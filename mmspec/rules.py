"""Acceptance rules: when a drafted token is kept, and what to draw from when it is not.

Every rule answers two questions for a drafted token x~ at one position, given the target distribution
p and the draft distribution q (``None`` means a deterministic draft: q is a point mass at x~):

* :meth:`AcceptanceRule.masses` returns ``(target_mass, draft_mass)``; the token is accepted iff
  ``u * draft_mass < target_mass`` for ``u ~ U(0, 1)``, i.e. with probability
  ``min(1, target_mass / draft_mass)``. Lossless speculative sampling uses ``(p(x~), q(x~))``; relaxed
  rules (LANTERN, GSD) raise the target mass; threshold rules (greedy, MuLo-SD) return 0 or 1.
* :meth:`AcceptanceRule.residual` returns the (unnormalised) weights to draw from at the first
  rejection. Greedy rules take the argmax of it instead of sampling (``rule.greedy``).

Writing acceptance as a mass comparison (no division) keeps the torch path and the fused Triton
kernel bit-identical for the same uniforms.

Residual of relaxed rules: for any rule whose relaxed mass satisfies p~(y) >= p(y), the TV-optimal
residual norm(max(0, p - q * f)) with f(y) = min(1, p~(y)/q(y)) simplifies to norm(max(0, p - q)):
where q(y) < p(y) <= p~(y) we get p - q, elsewhere 0. So LANTERN and GSD share the exact residual by
default. Switches reproduce the released code where it departs from that: LANTERN's residual heuristics
(``LanternRule(residual_kind=...)``) and longest-path choice in greedy trees (``tree_path="longest"``), GSD's
asymmetric group window (``GroupedRule(window="official")``); docs/official_code.md has the table.

Bad rows: while value checks are on, every public method refuses NaN, infinite, negative or all-zero rows of
its inputs (:func:`check_rule_inputs`). Verification checks its inputs once and calls the rules with the
checks off; there a NaN row still never becomes a token: its masses are NaN, every acceptance test
``u * draft_mass < target_mass`` (and each greedy comparison) is False for NaN, so the token is rejected, and
the residual it leaves is NaN, which the draw refuses (:mod:`mmspec.sampling`).
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import ClassVar

import torch

from mmspec import kernels
from mmspec.sampling import top_token
from mmspec.validation import check_ndim, check_positive_int, check_probability_rows, checks_enabled

RESIDUAL_EPS = 1e-9  # a residual with less total mass than this falls back to the target distribution

#: LanternRule residual kinds: the TV-optimal one, and the released code's two heuristics (see LanternRule).
LANTERN_RESIDUALS = ("tv", "zero_target_neighbors", "zero_draft_neighbors")
#: How a greedy rule picks its path through a draft tree (see AcceptanceRule.tree_path).
TREE_PATHS = ("first_accepted", "longest")
#: GroupedRule windows in the target's probability ranking (see GroupedRule).
GROUP_WINDOWS = ("symmetric", "official")


def check_rule_inputs(target_probs: torch.Tensor, draft_probs: torch.Tensor | None) -> None:
    """While value checks are on, refuse NaN, infinite, negative or all-zero rows of a rule's distributions
    with a :class:`~mmspec.validation.NonFiniteProbabilitiesError` naming the distribution and the row (see
    the module docstring for what happens with the checks off)."""
    if not checks_enabled():
        return
    check_probability_rows(target_probs, "target distribution (target_probs)")
    if draft_probs is not None:
        check_probability_rows(draft_probs, "draft distribution (draft_probs)")


def one_hot_like(tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Point-mass distributions ``[..., V]`` at ``tokens [...]`` with the dtype of ``probs``."""
    return torch.zeros_like(probs).scatter_(-1, tokens.unsqueeze(-1), 1.0)


def gather_token(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``probs[..., tokens]`` elementwise: ``[..., V]`` x ``[...]`` -> ``[...]``."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def exact_residual(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                   tokens: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)`` (q a point mass at ``tokens`` when None), or p where that has no mass (p = q up to
    rounding: a legitimate fallback). NaN rows stay NaN, for the draw to refuse."""
    check_rule_inputs(target_probs, draft_probs)
    q = one_hot_like(tokens, target_probs) if draft_probs is None else draft_probs
    residual = (target_probs - q).clamp_min_(0)
    empty = residual.sum(-1, keepdim=True) <= RESIDUAL_EPS
    return torch.where(empty, target_probs, residual)


class AcceptanceRule:
    """Base class. Subclasses implement :meth:`masses` and may override :meth:`residual`."""

    #: Greedy rules emit the argmax of the residual instead of sampling it.
    greedy: bool = False
    #: Name of the fused chain kernel mode that computes this rule exactly ("sample", "greedy"), if any.
    fused_kernel: str | None = None
    #: How a greedy rule chooses its path through a draft tree (:func:`mmspec.tree.verify_tree`):
    #: "first_accepted" follows, at each depth, the first sibling the rule accepts; "longest" judges every
    #: node against its parent's target distribution and keeps the longest accepted root path (ties: the
    #: first leaf in node order), which only differs for relaxed greedy rules that accept several
    #: siblings. Sampling rules always try siblings in order.
    tree_path: str = "first_accepted"
    #: Whether acceptance depends on where each draft lands: verification then calls :meth:`masses_at` with
    #: each token's depth in the round's draft (building the depths only for such rules).
    uses_depths: ClassVar[bool] = False
    #: Whether a greedy run must hand this rule the target's softmax. A rule that only reads the target's
    #: argmax (:class:`GreedyRule`) gets the argmax's one-hot distribution instead, which skips a softmax
    #: over the vocabulary per verified position; relaxed greedy rules (LANTERN's) need the real masses.
    reads_target_masses: ClassVar[bool] = True

    def masses(self, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
               tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(target_mass, draft_mass)`` of ``tokens [...]`` under ``[..., V]`` distributions."""
        raise NotImplementedError

    def masses_at(self, target_probs: torch.Tensor, draft_probs: torch.Tensor | None, tokens: torch.Tensor,
                  depths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`masses` of tokens at ``depths`` (broadcastable to ``tokens``; 1: the token right after the
        round's pending one; None where :attr:`uses_depths` is False). Position-free rules ignore them."""
        return self.masses(target_probs, draft_probs, tokens)

    def residual(self, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                 tokens: torch.Tensor) -> torch.Tensor:
        """Unnormalised weights ``[..., V]`` to draw the corrected token from after a rejection."""
        return exact_residual(target_probs, draft_probs, tokens)

    def acceptance_probs(self, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                         tokens: torch.Tensor) -> torch.Tensor:
        """Probability of accepting each token, ``min(1, target_mass / draft_mass)``."""
        target_mass, draft_mass = self.masses(target_probs, draft_probs, tokens)
        ratio = target_mass / draft_mass.clamp_min(torch.finfo(draft_mass.dtype).tiny)
        return ratio.clamp(max=1.0)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if the rule was built for another vocabulary (codebook neighbour tables)."""


@dataclass(frozen=True)
class ExactRule(AcceptanceRule):
    """Lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    Accept x~ with probability min(1, p(x~)/q(x~)); at the first rejection sample from
    norm(max(0, p - q)); deterministic drafts use q(x~) = 1.
    """

    fused_kernel = "sample"

    def masses(self, target_probs, draft_probs, tokens):
        check_rule_inputs(target_probs, draft_probs)
        p = gather_token(target_probs, tokens)
        q = torch.ones_like(p) if draft_probs is None else gather_token(draft_probs, tokens)
        return p, q


@dataclass(frozen=True)
class GreedyRule(AcceptanceRule):
    """Greedy decoding: accept while x~ is the target's argmax; emit the argmax at the first mismatch."""

    greedy = True
    fused_kernel = "greedy"
    reads_target_masses = False

    def masses(self, target_probs, draft_probs, tokens):
        check_rule_inputs(target_probs, draft_probs)
        best, argmax = top_token(target_probs)  # a NaN row's argmax is the NaN's index: never a match
        match = ((argmax == tokens) & (best > 0)).to(target_probs.dtype)
        return match, torch.ones_like(match)

    def residual(self, target_probs, draft_probs, tokens):
        check_rule_inputs(target_probs, draft_probs)
        return target_probs


def _check_neighbors(neighbors: torch.Tensor, k: int) -> None:
    check_ndim(neighbors, 2, "neighbors", "[V, k] (the k nearest other codebook entries of each token)")
    if neighbors.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"neighbors must be an integer tensor, got {neighbors.dtype}")
    check_positive_int(k, "k")
    if k > neighbors.shape[1]:
        raise ValueError(f"k={k} exceeds the {neighbors.shape[1]} neighbours per token in `neighbors`")
    own = torch.arange(neighbors.shape[0], device=neighbors.device).unsqueeze(1)
    if (neighbors[:, :k] == own).any():
        raise ValueError("neighbors must list the *other* codebook entries of each token (a row contains its own token)")


def _neighbor_mass(target_probs: torch.Tensor, tokens: torch.Tensor, neighbors: torch.Tensor, k: int,
                   budget: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target mass on the k nearest neighbours of each token, and with a ``budget`` LANTERN's c_J (the
    longest distance-ordered prefix whose mass stays within the budget).

    ``tokens`` is ``[...]`` (one token per distribution of ``target_probs [..., V]``) or ``[..., M]``
    (M tokens per distribution); results have the shape of ``tokens``. Runs the neighbourhood-mass
    kernel (Triton on CUDA, torch elsewhere) on the flattened positions.
    """
    vocab = target_probs.shape[-1]
    per_row = tokens.shape[-1] if tokens.ndim == target_probs.ndim else 1
    table = neighbors[:, :k].to(device=tokens.device, dtype=torch.long)
    flat_probs = target_probs.reshape(-1, vocab)
    flat_budget = None if budget is None else budget.reshape(-1, per_row).to(flat_probs.dtype)
    total, prefix = kernels.neighborhood_mass(flat_probs, tokens.reshape(-1, per_row), table, flat_budget,
                                              check_values=False)
    total = total.reshape(tokens.shape).to(target_probs.dtype)
    return total, None if prefix is None else prefix.reshape(tokens.shape).to(target_probs.dtype)


@dataclass(frozen=True)
class LanternRule(AcceptanceRule):
    """LANTERN relaxed acceptance over latent (codebook) neighbourhoods (arXiv 2410.03355).

    A = the longest distance-ordered prefix of the k nearest codebook neighbours of x~ whose cumulative
    target mass c_J stays <= delta (LANTERN, a total-variation budget) or <= (lam - 1) p(x~)
    (LANTERN++ multiplicative bound, used when ``lam`` is given). The relaxed mass p(x~) + c_J replaces
    p(x~) in the acceptance test. ``delta=0`` (or ``lam=1``) is exact speculative sampling.

    Args:
        neighbors: LongTensor ``[V, k_max]``, row t = the nearest *other* codebook entries of token t,
            ordered by distance (``-1`` pads); see ``codebook_neighbors`` in the tokenizers.
        k: how many neighbours to use (<= k_max).
        delta: TVD budget in [0, 1].
        lam: LANTERN++ bound (>= 1); when set, ``delta`` is ignored.
        greedy: greedy decoding: accept iff x~ becomes the argmax once its mass is relaxed.
        residual_kind: what a rejection leaves to draw from.

            * "tv" (default): the TV-optimal norm(max(0, p - q)) (see the module docstring).
            * "zero_target_neighbors": the released code's heuristic. When at least one neighbour fitted
              the budget (J >= 1), zero the target at x~'s ``k + 1`` nearest neighbours (the released
              slice ``[:k+1]`` of a table without the token itself), then take max(0, p - q); with a
              deterministic draft that is p with x~ and those neighbours zeroed. A residual with no mass
              left becomes uniform over the vocabulary (it may then emit a token of target probability 0).
            * "zero_draft_neighbors": as above but zero the *draft* q at those neighbours, as the
              released LlamaGen and Anole files do for sampled (EAGLE-1) drafts. A deterministic draft has
              no mass there; every released file then zeroes the target's, and so does this setting.

            Both heuristics need ``neighbors`` with ``k + 1`` columns (or all V - 1 other tokens).
        tree_path: "first_accepted" (default) or "longest" (the released code's choice in greedy trees),
            see :attr:`AcceptanceRule.tree_path`.
    """

    neighbors: torch.Tensor = field(repr=False)
    k: int = 1000
    delta: float = 0.1
    lam: float | None = None
    greedy: bool = False
    residual_kind: str = "tv"
    tree_path: str = "first_accepted"
    residual_mode: InitVar[str | None] = None  # the former name of ``residual_kind``: refused, naming it

    def __post_init__(self, residual_mode: str | None) -> None:
        if residual_mode is not None:
            spelling = "residual_kind='zero_target_neighbors' (or 'zero_draft_neighbors')" \
                if residual_mode == "official" else f"residual_kind={residual_mode!r}"
            raise ValueError(f"LanternRule(residual_mode=...) is now called `residual_kind`: use {spelling}")
        _check_neighbors(self.neighbors, self.k)
        if not 0.0 <= self.delta <= 1.0:
            raise ValueError(f"delta must be in [0, 1], got {self.delta}")
        if self.lam is not None and not self.lam >= 1.0:
            raise ValueError(f"lam must be >= 1, got {self.lam}")
        if self.residual_kind == "official":
            raise ValueError("residual_kind='official' is ambiguous: the released code zeroes the target's neighbours "
                             "(residual_kind='zero_target_neighbors': its EAGLE-2 mode, Lumina-mGPT's EAGLE-1 mode) "
                             "or the draft's (residual_kind='zero_draft_neighbors': LlamaGen's, Anole's EAGLE-1 mode)")
        if self.residual_kind not in LANTERN_RESIDUALS:
            raise ValueError(f"residual_kind must be one of {', '.join(map(repr, LANTERN_RESIDUALS))}, "
                             f"got {self.residual_kind!r}")
        if self.tree_path not in TREE_PATHS:
            raise ValueError(f"tree_path must be one of {', '.join(map(repr, TREE_PATHS))}, got {self.tree_path!r}")
        if self.residual_kind != "tv":
            columns = self._trimmed_columns()
            if self.neighbors.shape[1] < columns:
                raise ValueError(f"residual_kind={self.residual_kind!r} zeroes the k + 1 = {columns} nearest neighbours of a "
                                 f"rejected token: `neighbors` needs {columns} columns, got {self.neighbors.shape[1]}")
            own = torch.arange(self.neighbors.shape[0], device=self.neighbors.device)
            if (self.neighbors[:, self.k:columns] == own.unsqueeze(1)).any():
                raise ValueError("neighbors must list the *other* codebook entries of each token "
                                 "(a row contains its own token)")

    def _trimmed_columns(self) -> int:
        """Neighbours the released residual zeroes: ``k + 1``, at most the V - 1 other tokens."""
        return min(self.k + 1, self.neighbors.shape[0] - 1)

    def check_vocab(self, vocab_size: int) -> None:
        if self.neighbors.shape[0] != vocab_size:
            raise ValueError(f"LanternRule neighbors cover {self.neighbors.shape[0]} tokens but the target "
                             f"vocabulary has {vocab_size}")

    def budget(self, token_probs: torch.Tensor) -> torch.Tensor:
        """The neighbourhood budget for tokens of target probability ``token_probs [...]``."""
        if self.lam is not None:
            return (self.lam - 1.0) * token_probs
        return torch.full_like(token_probs, self.delta)

    def relaxed_mass(self, target_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """p(x~) + c_J for each token ``[...]``."""
        p = gather_token(target_probs, tokens)
        return p + _neighbor_mass(target_probs, tokens, self.neighbors, self.k, self.budget(p))[1]

    def masses(self, target_probs, draft_probs, tokens):
        check_rule_inputs(target_probs, draft_probs)
        relaxed = self.relaxed_mass(target_probs, tokens)
        if self.greedy:
            is_max = (relaxed >= target_probs.amax(-1)).to(relaxed.dtype)
            return is_max, torch.ones_like(is_max)
        q = torch.ones_like(relaxed) if draft_probs is None else gather_token(draft_probs, tokens)
        return relaxed, q

    def _released_residual(self, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                           tokens: torch.Tensor) -> torch.Tensor:
        """The released code's residual (``residual_kind`` "zero_target_neighbors" / "zero_draft_neighbors")."""
        check_rule_inputs(target_probs, draft_probs)
        ids = self.neighbors[:, : self._trimmed_columns()].to(tokens.device, torch.long)[tokens]  # [..., k+1]
        first = ids[..., 0]
        first_mass = gather_token(target_probs, first.clamp_min(0))
        fitted = (first >= 0) & (first_mass <= self.budget(gather_token(target_probs, tokens)))  # J >= 1
        hits = torch.zeros_like(target_probs, dtype=torch.long).scatter_add_(-1, ids.clamp_min(0), (ids >= 0).long())
        near = (hits > 0) & fitted.unsqueeze(-1)
        draft = one_hot_like(tokens, target_probs) if draft_probs is None else draft_probs
        if self.residual_kind == "zero_target_neighbors" or draft_probs is None:
            weights = (target_probs.masked_fill(near, 0.0) - draft).clamp_min(0)
        else:
            weights = (target_probs - draft.masked_fill(near, 0.0)).clamp_min(0)
        empty = weights.sum(-1, keepdim=True) == 0  # NaN rows stay NaN, for the draw to refuse
        return torch.where(empty, torch.ones_like(weights), weights)

    def residual(self, target_probs, draft_probs, tokens):
        if self.greedy:
            check_rule_inputs(target_probs, draft_probs)
            return target_probs
        if self.residual_kind != "tv":
            return self._released_residual(target_probs, draft_probs, tokens)
        return exact_residual(target_probs, draft_probs, tokens)


def _rank_keys(probs: torch.Tensor) -> torch.Tensor:
    """int64 keys ``[..., V]`` ordering the vocabulary by probability descending, then token id ascending
    (a larger key ranks earlier). The bit patterns of non-negative float32 values order like the values,
    so ``bits * V + (V - 1 - id)`` is a strict total order (+0.0 turns a -0.0 into 0)."""
    vocab = probs.shape[-1]
    bits = (probs.float() + 0.0).contiguous().view(torch.int32).to(torch.int64)
    return bits * vocab + (vocab - 1 - torch.arange(vocab, device=probs.device))


@dataclass(frozen=True)
class GroupedRule(AcceptanceRule):
    """GSD grouped acceptance (arXiv 2508.07747) for Speculative Jacobi Decoding.

    The group C of x~ holds x~ and its G - 1 neighbours in the target's probability ranking, kept only if
    |p(y) - p(x~)| < ``prob_threshold`` and, when ``embeddings`` are given, ||e_y - e_x~|| <
    ``distance_threshold``. Accept with probability min(1, p(C)/q(C)); resample from norm(max(0, p - q)).
    ``G=1`` is exact speculative sampling.

    ``window`` places the G - 1 neighbours:

    * "symmetric" (default): ceil((G-1)/2) more probable, floor((G-1)/2) less probable; near either end
      of the ranking the window holds what exists. Groups are nested in G, so for deterministic drafts
      (q(C) = 1) acceptance never decreases as G grows; for stochastic drafts the ratio of group masses is
      what the paper prescribes and is not monotone in general.
    * "official": the released code's window, the mirror image: floor((G-1)/2) more probable and
      ceil((G-1)/2) less probable (G = 14: 6 and 7). When fewer than ceil((G-1)/2) tokens rank below x~
      the released code has no window (its slice is empty) and falls back to plain min(1, p(x~)/q(x~));
      so does this setting. (For vocabularies smaller than G the released slice wraps around instead.)

    Ties in the ranking are broken by token id (the released code sorts with ``torch.sort``, whose order of
    equal values is unspecified).
    """

    G: int = 10
    prob_threshold: float = 0.15
    embeddings: torch.Tensor | None = field(default=None, repr=False)
    distance_threshold: float = float("inf")
    greedy: bool = False
    window: str = "symmetric"

    def __post_init__(self) -> None:
        check_positive_int(self.G, "G")
        if not self.prob_threshold > 0:
            raise ValueError(f"prob_threshold must be > 0, got {self.prob_threshold}")
        if self.embeddings is not None:
            check_ndim(self.embeddings, 2, "embeddings", "[V, D] (codebook embeddings)")
        if self.window not in GROUP_WINDOWS:
            raise ValueError(f"window must be one of {', '.join(map(repr, GROUP_WINDOWS))}, got {self.window!r}")

    def check_vocab(self, vocab_size: int) -> None:
        if self.embeddings is not None and self.embeddings.shape[0] != vocab_size:
            raise ValueError(f"GroupedRule embeddings cover {self.embeddings.shape[0]} tokens but the target "
                             f"vocabulary has {vocab_size}")

    def window_sides(self) -> tuple[int, int]:
        """``(more probable, less probable)``: how many neighbours of x~ the window takes on each side."""
        wide, narrow = self.G // 2, (self.G - 1) // 2
        return (wide, narrow) if self.window == "symmetric" else (narrow, wide)

    def group_mask(self, target_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Boolean ``[..., V]`` membership of each token's group C.

        The ranking is probability descending, token id ascending among equal probabilities, computed on
        the float32 values. Only the ``G - 1`` tokens next to x~ in it are needed, so two ``topk`` calls
        over integer rank keys find them without sorting the vocabulary (GSD's rule runs every round).
        """
        keys = _rank_keys(target_probs)  # [..., V]; a larger key ranks earlier
        key_x = keys.gather(-1, tokens.unsqueeze(-1))
        above, below = self.window_sides()
        members = [tokens.unsqueeze(-1)]
        no_window = None  # rows the released window cannot fill below x~ (official window only)
        for count, earlier in ((above, True), (below, False)):
            if count == 0:
                continue
            limit = torch.iinfo(keys.dtype).max if earlier else torch.iinfo(keys.dtype).min
            # the `count` nearest ranks on this side of x~ (topk pads with the limit when fewer exist)
            side = torch.where(keys > key_x if earlier else keys < key_x, keys, limit)
            values, ids = side.topk(min(count, keys.shape[-1]), dim=-1, largest=not earlier)
            padded = values == limit
            if not earlier and self.window == "official":
                no_window = padded.any(-1, keepdim=True)
            members.append(torch.where(padded, tokens.unsqueeze(-1), ids))  # pads become x~ itself
        members = torch.cat(members, -1)  # [..., <= G]
        p_x = gather_token(target_probs, tokens).unsqueeze(-1)
        keep = (target_probs.gather(-1, members) - p_x).abs() < self.prob_threshold
        if self.embeddings is not None:
            emb = self.embeddings.to(target_probs.device, target_probs.dtype)
            dist = (emb[members] - emb[tokens].unsqueeze(-2)).norm(dim=-1)
            keep &= dist < self.distance_threshold
        if no_window is not None:
            keep &= ~no_window  # the released code's fallback: x~ alone, plain min(1, p/q)
        keep |= members == tokens.unsqueeze(-1)  # x~ (and the pads standing for it) always belongs
        mask = torch.zeros_like(target_probs, dtype=torch.bool)
        return mask.scatter_(-1, members, keep)

    def masses(self, target_probs, draft_probs, tokens):
        if self.G == 1:  # (the delegates check the inputs)
            return ExactRule().masses(target_probs, draft_probs, tokens) if not self.greedy \
                else GreedyRule().masses(target_probs, draft_probs, tokens)
        check_rule_inputs(target_probs, draft_probs)
        group = self.group_mask(target_probs, tokens).to(target_probs.dtype)
        p_group = (target_probs * group).sum(-1)
        if self.greedy:
            is_max = (p_group >= target_probs.amax(-1)).to(p_group.dtype)
            return is_max, torch.ones_like(is_max)
        q_group = torch.ones_like(p_group) if draft_probs is None else (draft_probs * group).sum(-1)
        return p_group, q_group

    def residual(self, target_probs, draft_probs, tokens):
        if self.greedy:
            check_rule_inputs(target_probs, draft_probs)
            return target_probs
        return exact_residual(target_probs, draft_probs, tokens)


@dataclass(frozen=True)
class PoolingThresholdRule(AcceptanceRule):
    """MuLo-SD pooled threshold acceptance (arXiv 2601.05149).

    Accept x~ iff the target mass pooled over x~ and its k nearest codebook neighbours reaches ``tau``:
    p(x~) + sum_{y in B_k(x~)} p(y) >= tau. Deterministic (no uniform is used). A rejected token is
    redrawn from the target where it was drafted deterministically; with a stochastic draft q the
    residual is the TV form norm(max(0, p - q f)) with f(y) = 1[pooled mass of y >= tau].
    """

    neighbors: torch.Tensor = field(repr=False)
    k: int = 8
    tau: float = 0.5
    greedy: bool = False

    def __post_init__(self) -> None:
        _check_neighbors(self.neighbors, self.k)
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"tau must be in [0, 1], got {self.tau}")

    def check_vocab(self, vocab_size: int) -> None:
        LanternRule.check_vocab(self, vocab_size)  # same neighbour-table contract

    def pooled_mass(self, target_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return gather_token(target_probs, tokens) + _neighbor_mass(target_probs, tokens, self.neighbors, self.k)[0]

    def masses(self, target_probs, draft_probs, tokens):
        check_rule_inputs(target_probs, draft_probs)
        accept = (self.pooled_mass(target_probs, tokens) >= self.tau).to(target_probs.dtype)
        return accept, torch.ones_like(accept)

    def residual(self, target_probs, draft_probs, tokens):
        check_rule_inputs(target_probs, draft_probs)
        if self.greedy or draft_probs is None:
            return target_probs
        every = torch.arange(target_probs.shape[-1], device=tokens.device).expand_as(target_probs)
        pooled_all = target_probs + _neighbor_mass(target_probs, every, self.neighbors, self.k)[0]
        f = (pooled_all >= self.tau).to(target_probs.dtype)
        residual = (target_probs - draft_probs * f).clamp_min(0)
        empty = residual.sum(-1, keepdim=True) <= RESIDUAL_EPS
        return torch.where(empty, target_probs, residual)
