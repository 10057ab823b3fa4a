"""Drafters that need no training of their own.

* :class:`ModelDrafter`: a smaller causal LM of the same vocabulary, the classic draft-model speculative
  decoding (Leviathan et al. 2023) and the reference implementation of the
  :class:`~mmspec.speculate.Drafter` interface: chain drafting (greedy or sampled, returning the
  distributions it sampled from) and dynamic trees (EAGLE-2's or entropy-adaptive, :class:`TreeConfig`).
* :class:`JacobiDrafter`: Speculative Jacobi Decoding (SJD, arXiv 2410.01699), no draft model: the
  drafts of a round are the target's own samples from the previous round.

Feature-level heads (EAGLE, FLASH, ViSpec, SpecVLM) and MuLo-SD live in ``mmspec.models`` and implement
the same interface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmspec.cache import keep_valid_slots
from mmspec.runner import CausalLMRunner
from mmspec.sampling import SamplingConfig, coupled_redraw, draw_uniforms, first_argmax, sample, top_token
from mmspec.speculate import DraftChain, Drafter, PrefillContext, RoundResult, target_probs_fn
from mmspec.tree import DraftTree, StepFn, TreeAttentionBuilder, expand_dynamic_tree, expand_entropy_tree
from mmspec.validation import TREE_LIMITS, check_count, check_positive_int, check_unit_interval


def one_hot_probs(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Point-mass distributions ``[..., V]`` (float64) at ``tokens``."""
    return torch.nn.functional.one_hot(tokens, vocab_size).to(torch.float64)

def check_chain_confidence(confidence_threshold: float, tree: TreeConfig | None) -> None:
    """A drafter's ``confidence_threshold`` (:func:`draft_chain`) is in [0, 1) and not set with a tree."""
    check_unit_interval(confidence_threshold, "confidence_threshold")
    if tree is not None and confidence_threshold > 0:
        raise ValueError("confidence_threshold sets the length of draft chains; an EAGLE-2 tree is "
                         "dynamic already (pass one or the other)")


def draft_chain(logits: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor], num_tokens: int,
                sampling: SamplingConfig, generator: torch.Generator | None,
                confidence_threshold: float = 0.0, argmax: bool = False) -> DraftChain:
    """Autoregressive chain drafting shared by every drafter, one token or one block per drafter forward.

    Args:
        logits: ``[B, V]`` the drafter's logits for the first draft, or ``[B, k, V]`` for a first *block* of
            k drafts (a semi-autoregressive drafter such as FLASH's head proposes k tokens per forward; each
            is drawn from its own distribution, which is what exact verification needs).
        step: feeds what was drafted and returns the next logits of the same kind: ``step(token [B]) ->
            [B, V]``, or for blocks ``step(block [B, k]) -> [B, k', V]``.
        num_tokens: K, the longest chain (a last block is cut to fit); sampling: greedy drafts
            (deterministic, ``probs=None``) or sampled drafts returned with the distributions they were drawn
            from.
        confidence_threshold: dynamic chain length. After each draft the chain stops early when, in
            every row, the drafter gave its drafted token less than this probability: later drafts
            would most likely be rejected, and each costs a drafter forward. A block is cut after its
            first such draft. 0 (default) always drafts K. The stop depends only on the drafter's own
            distributions, so verification stays exact (a shorter chain only moves the target's bonus
            token earlier).
        argmax: under sampling, draft each distribution's most likely token instead of drawing one: point-mass
            proposals (``probs=None``; exact verification stays lossless). The confidence cut still reads
            the sampling distribution (temperature, top-k/top-p applied).

    Returns a chain of 1 to K tokens (the same length in every row).
    """
    to_probs = target_probs_fn(sampling)
    drawing = sampling.do_sample and not argmax
    tokens, dists, drafted = [], [], 0
    while True:
        probs = to_probs(logits)
        if drawing:
            drawn = sample(probs, generator, name="draft distribution")
            mass = None  # read below only when the chain length is dynamic
        else:  # the most likely token and its probability in one operation
            mass, drawn = top_token(probs)
        block, block_probs = (drawn, probs) if probs.ndim == 3 else (drawn.unsqueeze(1), probs.unsqueeze(1))
        take = min(block.shape[1], num_tokens - drafted)
        stop = drafted + take == num_tokens
        if confidence_threshold > 0:  # one host read per forward: is each kept draft unsure in every row?
            if mass is None:
                mass = block_probs.gather(-1, block.unsqueeze(-1))[..., 0]
            confidence = mass.reshape(block.shape)[:, :take].amax(0)
            unsure = (confidence < confidence_threshold).tolist()
            if True in unsure:
                take, stop = unsure.index(True) + 1, True
        tokens.append(block[:, :take])
        if drawing:  # argmax drafts are point masses: no distributions to return
            dists.append(block_probs[:, :take])
        drafted += take
        if stop:
            break
        logits = step(drawn)
    return DraftChain(torch.cat(tokens, 1), torch.cat(dists, 1) if drawing else None)


#: the adaptive expansions a :class:`TreeConfig` can name (None: EAGLE-2's)
ADAPTIVE_TREES = (None, "entropy")


@dataclass(frozen=True)
class TreeConfig:
    """A dynamic draft tree: ``depth`` levels, ``top_k`` branching, ``total_tokens`` nodes verified.

    ``adaptive=None`` is EAGLE-2's expansion (:func:`~mmspec.tree.expand_dynamic_tree`: every level expands
    its ``top_k`` best nodes). ``adaptive="entropy"`` (:func:`~mmspec.tree.expand_entropy_tree`) expands
    each node into as many branches as the drafter's entropy there suggests and stops early where no deeper
    node could be kept, and past ``depth`` it follows the best path while the drafter is sure of every step
    (up to ``total_tokens`` levels): deep and narrow where the drafter is confident, shallow and wide where
    it is not. Both keep the ``total_tokens`` best nodes and are verified exactly, so either is lossless.
    """

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 48
    adaptive: str | None = None

    def __post_init__(self) -> None:
        check_positive_int(self.depth, "TreeConfig.depth")  # capped by total_tokens and what is left
        for name, maximum in TREE_LIMITS.items():
            check_count(getattr(self, name), f"TreeConfig.{name}", maximum)
        if self.adaptive not in ADAPTIVE_TREES:
            allowed = ", ".join(repr(name) for name in ADAPTIVE_TREES)
            raise ValueError(f"TreeConfig.adaptive must be one of {allowed}, got {self.adaptive!r}")

    def expand(self, root_log_probs: torch.Tensor, step_fn: StepFn, depth_limit: int | None = None) -> DraftTree:
        """Grow this tree with a drafter (``step_fn`` as in :func:`~mmspec.tree.expand_dynamic_tree`), no deeper
        than ``depth_limit`` (a drafter's :attr:`~mmspec.speculate.Drafter.draft_limit`; None: no limit)."""
        limit = self.total_tokens if depth_limit is None else depth_limit
        depth = min(self.depth, limit)
        if self.adaptive == "entropy":
            return expand_entropy_tree(root_log_probs, step_fn, depth, self.top_k, self.total_tokens,
                                       max_depth=min(self.total_tokens, limit))
        return expand_dynamic_tree(root_log_probs, step_fn, depth, self.top_k, self.total_tokens)


class ModelDrafter(Drafter):
    """Draft with a small causal LM that shares the target's vocabulary.

    Args:
        model: a transformers causal LM (its own KV cache is managed by a :class:`CausalLMRunner`), or a
            runner (e.g. a :class:`~mmspec.runner.GuidedRunner` to draft under classifier-free guidance).
        num_draft_tokens: K drafts per round (chain mode; fewer where less is left to generate,
            :attr:`~mmspec.speculate.Drafter.draft_limit`).
        sampling: must equal the target's sampling config: drafts are drawn from the same processed
            distribution family (greedy drafting when ``do_sample=False``).
        tree: draft a dynamic tree instead of a chain (deterministic top-k expansion, :class:`TreeConfig`).
        generator: random source for sampled drafts.
        share_model_inputs: give the drafter's prefill the same extra inputs as the target's (image
            pixels, condition ids); False for a text-only drafter of a multimodal target.
        confidence_threshold: dynamic chain length (:func:`draft_chain`); 0 drafts K every round.
    """

    def __init__(self, model: Any, num_draft_tokens: int = 4, sampling: SamplingConfig = SamplingConfig(do_sample=False),
                 tree: TreeConfig | None = None, generator: torch.Generator | None = None,
                 share_model_inputs: bool = True, confidence_threshold: float = 0.0) -> None:
        check_positive_int(num_draft_tokens, "num_draft_tokens")
        check_chain_confidence(confidence_threshold, tree)
        self.confidence_threshold = confidence_threshold
        self.runner = model if hasattr(model, "begin_round") else CausalLMRunner(model)
        self.num_draft_tokens, self.sampling, self.tree, self.generator = num_draft_tokens, sampling, tree, generator
        self.share_model_inputs = share_model_inputs
        self._backlog: torch.Tensor | None = None  # committed tokens not yet in the draft cache, -1 pad

    @property
    def calls(self) -> int:
        return self.runner.calls

    def prefill(self, context: PrefillContext) -> None:
        vocab = self.runner.vocab_size
        if context.target.logits.shape[-1] != vocab:
            raise ValueError(f"vocab mismatch: the drafter has {vocab} tokens, the target {context.target.logits.shape[-1]}")
        extra = context.model_inputs if self.share_model_inputs else {}
        self.runner.prefill(context.input_ids, context.attention_mask, **extra)
        self._backlog = context.first_tokens.new_full((context.first_tokens.shape[0], 0), -1)

    def _feed_pending(self, pending: torch.Tensor) -> torch.Tensor:
        """Start a round: feed the backlog and the pending token; returns logits after pending ``[B, V]``."""
        self.runner.begin_round()
        tokens = torch.cat([self._backlog, pending.unsqueeze(1)], 1)
        self._prefix_valid = tokens >= 0
        return self.runner.forward(tokens.clamp_min(0), valid=self._prefix_valid).logits[:, -1]

    def propose(self, pending: torch.Tensor) -> DraftChain | DraftTree:
        logits = self._feed_pending(pending)
        if self.tree is not None:
            return self._propose_tree(logits)
        chain = draft_chain(logits, lambda token: self.runner.forward(token.unsqueeze(1)).logits[:, 0],
                            self.capped(self.num_draft_tokens), self.sampling, self.generator,
                            self.confidence_threshold)
        self._drafted = chain.tokens.shape[1]  # K, or fewer when the chain stopped early
        return chain

    def _propose_tree(self, root_logits: torch.Tensor) -> DraftTree:
        batch = root_logits.shape[0]
        builder = TreeAttentionBuilder(batch, root_logits.device)
        tree_start = self.runner.num_slots

        def step(tokens, node_ids, parent_ids, depth):
            offsets, attention = builder.frontier_inputs(node_ids, parent_ids, depth, tree_start)
            logits = self.runner.forward(tokens, offsets=offsets, attention=attention).logits
            return logits.log_softmax(-1)

        root = root_logits.log_softmax(-1)
        return self.tree.expand(root, step, self.draft_limit)

    def commit(self, result: RoundResult) -> None:
        prefix = self._prefix_valid.shape[1]
        prefix_keep = keep_valid_slots(self._prefix_valid)
        accepted = result.committed[:, 1:]  # accepted drafts, -1 pad
        if self.tree is not None:
            # Tree slots are dropped; the accepted path is fed at the start of the next round.
            self.runner.commit(prefix_keep)
            self._backlog = accepted
            return
        drafted = self._drafted
        fed = drafted - 1  # drafts 1..k-1 of the round's k are in the cache, draft k never was
        steps = torch.arange(fed, device=accepted.device)
        drafts_keep = torch.where(steps < result.num_accepted.unsqueeze(-1), prefix + steps, -1)
        self.runner.commit(torch.cat([prefix_keep, drafts_keep], 1))
        last_draft = accepted[:, -1:] if accepted.shape[1] == drafted else accepted[:, :0]
        self._backlog = torch.where(result.num_accepted.unsqueeze(-1) == drafted, last_draft, -1) \
            if last_draft.shape[1] else last_draft


#: JacobiDrafter's choices for the q of fresh random slots
FRESH_Q = ("uniform", "one_hot")
#: how JacobiDrafter(coupled=True) couples a slot's redraw with its previous token
COUPLINGS = ("maximal", "gumbel")


class JacobiDrafter(Drafter):
    """Speculative Jacobi Decoding: a window of ``window`` draft slots refined by the target itself.

    Round r verifies the window; the accepted prefix and the corrected token are committed; every slot
    after them is redrawn from the target distribution this round computed for it (that distribution
    becomes its q, so verification stays exact speculative sampling); the slots freed at the end are
    filled by ``init``: "random" (uniform over ``token_range``, q uniform) or "left" (a copy of the
    left neighbour, a deterministic point mass). Greedy decoding redraws by argmax (Jacobi decoding).

    ``coupled=True`` is speculative coupled decoding (SCD, first titled MC-SJD): a slot's redraw is maximally
    coupled with the token it held (:func:`~mmspec.sampling.coupled_redraw`), so it keeps that token with the
    largest probability the two distributions allow instead of drawing independently. Each slot's redraw is
    still distributed exactly as its new q, so verification, and with it the output, is unchanged in
    distribution; the drafts only flicker less between rounds and are accepted more often.

    Args:
        vocab_size: target vocabulary size.
        window: L draft slots per round (SJD uses 16 for images); a round proposes the first
            :attr:`~mmspec.speculate.Drafter.draft_limit` of them where less is left to generate.
        sampling: the target's sampling config (greedy or sampled refinement).
        init: "random" or "left".
        token_range: ``(low, high)`` ids random initialisation draws from (e.g. the image-token range).
        generator: random source for initialisation and redraws.
        coupled: redraw slots coupled with their previous tokens (SCD) instead of independently (SJD).
        keep_last_draw: also keep a draw from the target's distribution after the last draft (which the
            round computes anyway) as the next window's draft at that position, with that distribution as
            its q, instead of a fresh random slot there: every released SCD variant does; lossless like
            any redraw (the draw's law is a function of the tokens before its position).
        fresh_q: the q of fresh random slots: "uniform" (the law they are drawn from) or "one_hot" (a point
            mass at the drawn token, as the released SCD code declares it). Both are exact (a drawn token
            with q its law, or a token fixed before its position is verified with q its point mass); the
            uniform q accepts more (min(1, p(x) * n) instead of p(x) over n tokens) and, under coupled
            redraws, keeps the token more often.
        coupling: how ``coupled`` redraws couple a slot with its previous token: "maximal" (keep it with
            probability min(1, p/q), else draw from the residual: the largest probability of keeping it) or
            "gumbel" (the released SCD code's Gumbel mode: every slot holds fixed Gumbel noise g [V] from the
            moment it is filled until it is consumed, and each redraw is argmax(log p + g), an exact draw from
            p; the noise is never read by a verification before the slot's own, so the draw is still
            distributed as p given everything verification has seen).
    """

    def __init__(self, vocab_size: int, window: int = 16, sampling: SamplingConfig = SamplingConfig(do_sample=False),
                 init: str = "random", token_range: tuple[int, int] | None = None,
                 generator: torch.Generator | None = None, coupled: bool = False, keep_last_draw: bool = False,
                 fresh_q: str = "uniform", coupling: str = "maximal") -> None:
        check_positive_int(window, "window")
        if coupling not in COUPLINGS:
            raise ValueError(f"coupling must be one of {list(COUPLINGS)}, got {coupling!r}")
        self.gumbel = bool(coupled) and coupling == "gumbel" and sampling.do_sample
        self._noise: torch.Tensor | None = None  # [B, L, V] the Gumbel noise of each slot (coupling="gumbel")
        if init not in ("random", "left"):
            raise ValueError(f"init must be 'random' or 'left', got {init!r}")
        if fresh_q not in FRESH_Q:
            raise ValueError(f"fresh_q must be one of {list(FRESH_Q)}, got {fresh_q!r}")
        self.keep_last_draw, self.fresh_q = bool(keep_last_draw), fresh_q
        low, high = token_range if token_range is not None else (0, vocab_size)
        if not 0 <= low < high <= vocab_size:
            raise ValueError(f"token_range must satisfy 0 <= low < high <= vocab_size={vocab_size}, got {token_range}")
        self.vocab_size, self.window, self.sampling, self.init = vocab_size, window, sampling, init
        self.low, self.high, self.generator, self.coupled = low, high, generator, bool(coupled)
        self._tokens: torch.Tensor | None = None  # [B, L]
        self._probs: torch.Tensor | None = None   # [B, L, V] (sampling) — q of each slot

    def prefill(self, context: PrefillContext) -> None:
        if context.target.logits.shape[-1] != self.vocab_size:
            raise ValueError(f"vocab mismatch: the Jacobi drafter was built for {self.vocab_size} tokens, the target "
                             f"has {context.target.logits.shape[-1]}")
        batch = context.first_tokens.shape[0]
        logits_dtype = context.target.logits.dtype
        self._dtype = torch.float32 if logits_dtype in (torch.float16, torch.bfloat16) else logits_dtype
        self._tokens = context.first_tokens.new_zeros(batch, 0)
        self._probs = None
        self._noise = None
        self._fill(context.first_tokens)

    def _gumbel_noise(self, batch: int, slots: int, like: torch.Tensor) -> torch.Tensor:
        """Fresh Gumbel noise ``[batch, slots, V]`` (``-log(-log(u))``, u from the generator)."""
        u = draw_uniforms((batch, slots, self.vocab_size), like, self.generator)
        return -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))

    def _uniform(self, batch: int, slots: int, like: torch.Tensor) -> torch.Tensor:
        probs = torch.zeros(batch, slots, self.vocab_size, dtype=self._dtype, device=like.device)
        probs[..., self.low:self.high] = 1.0 / (self.high - self.low)
        return probs

    def _fill(self, last_committed: torch.Tensor) -> None:
        """Append freshly initialised slots until the window is full."""
        batch, have = self._tokens.shape
        missing = self.window - have
        if missing <= 0:
            return
        if self.gumbel:
            noise = self._gumbel_noise(batch, missing, torch.empty(0, dtype=self._dtype, device=self._tokens.device))
            self._noise = noise if self._noise is None else torch.cat([self._noise, noise], 1)
        if self.init == "random" and self.sampling.do_sample:
            probs = self._uniform(batch, missing, self._tokens)
            new = sample(probs, self.generator)
            if self.fresh_q == "one_hot":  # the drawn token is then verified as a point mass
                probs = None
        else:  # copies of the left neighbour (also the greedy Jacobi default): point masses
            left = self._tokens[:, -1] if have else last_committed
            new = left.unsqueeze(1).expand(batch, missing)
            probs = None
        self._tokens = torch.cat([self._tokens, new], 1)
        if self.sampling.do_sample:
            old = self._probs if self._probs is not None else self._uniform(batch, 0, new)
            fresh = probs if probs is not None else one_hot_probs(new, self.vocab_size).to(self._dtype)
            self._probs = torch.cat([old, fresh], 1)

    def propose(self, pending: torch.Tensor) -> DraftChain:
        width = self.capped(self.window)
        probs = self._probs[:, :width] if self.sampling.do_sample else None
        return DraftChain(self._tokens[:, :width].clone(), probs)

    def commit(self, result: RoundResult) -> None:
        if result.target_probs is None:
            raise ValueError("JacobiDrafter needs the round's target distributions")
        emitted = result.num_accepted + 1  # slots consumed per row (accepted drafts + corrected token)
        # Redraw every proposed slot (the window, or its first draft_limit) from the target distribution
        # this round computed for it; slots past the proposed ones are dropped and refilled below.
        proposed = result.target_probs.shape[1] - 1
        # with keep_last_draw, also the position after the last draft: [B, L+1, V] (no draft held it)
        width = proposed + 1 if self.keep_last_draw else proposed
        target = result.target_probs[:, :width].to(self._dtype)  # [B, width, V] q for the next round
        if not self.sampling.do_sample:
            redrawn = first_argmax(target)
        elif self.gumbel:  # each slot's fixed noise: argmax(log p + g) is an exact draw from p
            noise = self._noise[:, :width]
            if noise.shape[1] < width:
                noise = torch.cat([noise, self._gumbel_noise(noise.shape[0], width - noise.shape[1], target)], 1)
            redrawn = first_argmax(target.log() + noise)
        elif self.coupled:  # the slots held this round's drafts, drawn from self._probs
            redrawn = coupled_redraw(self._tokens[:, :proposed], self._probs[:, :proposed], target[:, :proposed],
                                     self.generator, name="target distribution")
            if width > proposed:
                redrawn = torch.cat([redrawn, sample(target[:, proposed:], self.generator,
                                                     name="target distribution")], 1)
        else:
            redrawn = sample(target, self.generator, name="target distribution")
        # Drop the consumed slots per row (shift left by `emitted`), then refill the end.
        index = (torch.arange(width, device=redrawn.device).unsqueeze(0) + emitted.unsqueeze(1))
        valid = index < width
        tokens = redrawn.gather(1, index.clamp(max=width - 1))
        keep = int(valid.sum(1).min())
        self._tokens = tokens[:, :keep]
        if self.sampling.do_sample:
            probs = target.gather(1, index.clamp(max=width - 1).unsqueeze(-1).expand(-1, -1, target.shape[-1]))
            self._probs = probs[:, :keep]
        if self.gumbel:
            self._noise = noise.gather(1, index.clamp(max=width - 1).unsqueeze(-1).expand(-1, -1, noise.shape[-1]))
            self._noise = self._noise[:, :keep]
        # Rows that consumed fewer slots than the batch maximum lose their extra kept slots: their
        # tokens were drawn from valid distributions, but slots must align across rows.
        self._fill(result.next_tokens)
