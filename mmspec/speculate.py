"""One speculation loop for every token-level method.

The loop runs any :class:`Drafter` against any target (a :class:`Target`, e.g.
:class:`~mmspec.runner.CausalLMRunner`) with any acceptance rule, batched, recording
:class:`~mmspec.stats.SpecStats`. A round is:

1. the drafter proposes a chain ``[B, K]`` (with its distributions, or None if deterministic) or a tree;
2. the target scores ``[pending, drafts...]`` in one forward (a tree with its attention mask);
3. the core verifies (``verify_tokens`` / ``verify_tree``), the only accept/reject decision;
4. target and drafter keep the accepted slots of their caches and the new pending token is appended.

A round drafts at most what the longest active row has left to generate minus one (the target's token
completes it): :attr:`Drafter.draft_limit`. Any ``num_draft_tokens`` is therefore capped by
``max_new_tokens`` (a round whose rows need one token is a target-only forward), which never changes what a
lossless method outputs, and a batch-1 round never places a token past prompt + ``max_new_tokens``.

``drafter=None`` is the target-only baseline in the same code path (one token per target forward),
which is what ``method="none"`` of every pipeline runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from mmspec.rules import AcceptanceRule, ExactRule, GreedyRule
from mmspec.runner import StepOutput
from mmspec.sampling import SamplingConfig, draw, logits_to_probs
from mmspec.stats import SpecStats
from mmspec.tree import DraftTree, tree_attention_mask, tree_position_offsets, verify_tree
from mmspec.validation import check_ndim, check_positive_int, value_checks
from mmspec.verify import verify_tokens


class Target(Protocol):
    """What the loop needs from a target model (see :class:`~mmspec.runner.CausalLMRunner`)."""

    vocab_size: int

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **model_inputs: Any) -> StepOutput: ...
    def begin_round(self) -> None: ...
    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                attention: torch.Tensor | None = None) -> StepOutput: ...
    @property
    def num_slots(self) -> int: ...
    def commit(self, keep: torch.Tensor) -> None: ...


@dataclass
class DraftChain:
    """``tokens [B, K]`` and the distributions ``probs [B, K, V]`` they were drawn from (None: deterministic)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None


@dataclass
class PrefillContext:
    """What a drafter sees after the target's prefill."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target: StepOutput
    first_tokens: torch.Tensor  # [B] the target's first generated token (the first pending token)
    model_inputs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoundResult:
    """What a round committed, for the drafter to update itself.

    Attributes:
        committed: LongTensor ``[B, M]``: the previous pending token then the accepted drafts (-1 pad).
        num_accepted: LongTensor ``[B]`` accepted drafts per row.
        next_tokens: LongTensor ``[B]`` the new pending token (corrected or bonus).
        target_hidden: ``[B, M, D]`` target top hidden states of ``committed`` (None if not computed;
            ``[2B, M, D]`` ``[cond; uncond]`` when a guided target returns both halves).
        path: accepted tree node indices ``[B, D]`` (-1 pad) for tree rounds, else None.
        target_probs: the processed target distributions of the round ``[B, K+1, V]`` (``[B, N+1, V]``
            for trees), which Jacobi-style drafters turn into their next drafts.
        target_penultimate: ``[B, M, D]`` the target's penultimate hidden states of ``committed``, when the
            target returns them (``VLMRunner(..., return_penultimate=True)``; SpecVLM-style heads).
        accepted_counts: ``num_accepted`` read on the host (the loop reads it once per round), or None.
    """

    committed: torch.Tensor
    num_accepted: torch.Tensor
    next_tokens: torch.Tensor
    target_hidden: torch.Tensor | None = None
    path: torch.Tensor | None = None
    target_probs: torch.Tensor | None = None
    target_penultimate: torch.Tensor | None = None
    accepted_counts: list[int] | None = None

    def num_accepted_list(self) -> list[int]:
        """``num_accepted`` on the host: :attr:`accepted_counts`, or one read of the tensor."""
        if self.accepted_counts is None:
            self.accepted_counts = self.num_accepted.tolist()
        return self.accepted_counts


class Drafter(ABC):
    """A drafting strategy (a draft model, an EAGLE/FLASH/ViSpec/SpecVLM head, Jacobi, MuLo-SD...).

    Besides the three abstract methods, a drafter declares here every capability a loop or pipeline asks of
    it, so nothing is found by probing attributes: which target features it reads (:attr:`needs_target_hidden`,
    :attr:`target_hidden`), whether it can sit out a round (:attr:`can_skip_rounds`,
    :meth:`commit_undrafted`) and, for VLM heads, how many visual positions it attends to
    (:attr:`draft_visual_tokens`).
    """

    #: whether the drafter wants the target's top hidden states (feature-level drafters)
    needs_target_hidden: bool = False
    #: under classifier-free guidance, which hidden states it reads: "cond" (the conditional half), "both"
    #: (both halves, drafting guided logits) or "guided" (one row of guided features)
    target_hidden: str = "cond"
    #: whether :meth:`commit_undrafted` is implemented (a lookup tail can then draft a round without it)
    can_skip_rounds: bool = False
    #: visual positions the drafter attends to per row (``[B]``; VLM heads that compress the image set it
    #: at prefill); None: it does not say (a drafter reading the whole image span, or none)
    draft_visual_tokens: torch.Tensor | None = None
    #: the most drafts the next ``propose`` may return (a chain's length, a tree's depth): set by
    #: :func:`speculative_generate` before every round to what its longest active row has left to generate
    #: minus one (drafts past that would be discarded); None (outside the loop): no limit
    draft_limit: int | None = None

    def capped(self, num_tokens: int) -> int:
        """``num_tokens`` cut to :attr:`draft_limit` (what a drafter drafts this round instead of its K)."""
        return num_tokens if self.draft_limit is None else min(num_tokens, self.draft_limit)

    @property
    def calls(self) -> int:
        """Draft forward passes run so far (for :class:`SpecStats`)."""
        return 0

    @abstractmethod
    def prefill(self, context: PrefillContext) -> None:
        """Read the prompt (and the target's prefill outputs) before the first round."""

    @abstractmethod
    def propose(self, pending: torch.Tensor) -> DraftChain | DraftTree:
        """Propose drafts that follow ``pending [B]`` (the last committed, not yet scored token)."""

    @abstractmethod
    def commit(self, result: RoundResult) -> None:
        """Learn what was accepted; roll back anything else (its own cache)."""

    def commit_undrafted(self, result: RoundResult) -> None:
        """Learn a round another drafter proposed for (a lookup tail's round); only drafters with
        :attr:`can_skip_rounds` implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot sit out a round (can_skip_rounds is False)")


@dataclass
class SpeculativeOutput:
    """Result of :func:`speculative_generate`.

    Attributes:
        sequences: LongTensor ``[B, L]`` generated tokens (prompt excluded), ``pad_token_id`` after the end.
        lengths: LongTensor ``[B]`` generated tokens per row (EOS included).
        drafted: bool ``[B, L]``: True where the token was a drafted-and-accepted token, False where the
            target produced it (prefill token, corrections, bonus tokens).
        stats: :class:`SpecStats`.
    """

    sequences: torch.Tensor
    lengths: torch.Tensor
    drafted: torch.Tensor
    stats: SpecStats


def default_rule(sampling: SamplingConfig) -> AcceptanceRule:
    return ExactRule() if sampling.do_sample else GreedyRule()


def target_probs_fn(sampling: SamplingConfig,
                    rule: AcceptanceRule | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Logits -> the distribution verification compares against.

    Greedy decoding keeps the full softmax (relaxed greedy rules such as LANTERN need real masses) unless
    ``rule`` reads only the target's argmax (``reads_target_masses`` False, :class:`GreedyRule`): it then
    gets the argmax's one-hot distribution, the same decisions without a softmax over the vocabulary (and
    a row with a non-finite logit raises, naming the target distribution).
    """
    if not sampling.do_sample and not getattr(rule, "reads_target_masses", True):
        return lambda logits: logits_to_probs(logits, sampling, name="target distribution")
    config = sampling if sampling.do_sample else SamplingConfig(do_sample=True, top_k=sampling.top_k,
                                                                top_p=sampling.top_p)
    return lambda logits: logits_to_probs(logits, config)


@torch.no_grad()
def speculative_generate(target: Target, drafter: Drafter | None, input_ids: torch.Tensor | None,
                         attention_mask: torch.Tensor | None = None, *, max_new_tokens: int = 64,
                         sampling: SamplingConfig = SamplingConfig(do_sample=False), rule: AcceptanceRule | None = None,
                         eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
                         generator: torch.Generator | None = None, stats: SpecStats | None = None,
                         callback: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                         **model_inputs: Any) -> SpeculativeOutput:
    """Generate up to ``max_new_tokens`` per row, speculatively when a drafter is given.

    Args:
        target: the target model interface; drafter: a :class:`Drafter` or None (target-only baseline).
        input_ids / attention_mask: ``[B, T]`` prompt (padding allowed); ``model_inputs`` go to the
            target's prefill (e.g. ``pixel_values``). ``input_ids`` may be None for prompts given as
            model inputs (e.g. an image model's condition), with ``attention_mask`` giving their layout.
        sampling: how logits become distributions; greedy when ``do_sample=False``.
        rule: acceptance rule (default ExactRule when sampling, GreedyRule when greedy).
        callback: called after every round with ``(new_tokens [B, M] (-1 pad), drafted [B, M])`` for
            streaming: the tokens each row really gained (cut at its EOS or ``max_new_tokens``; -1 for rows
            that had already finished).
    """
    if input_ids is not None:
        check_ndim(input_ids, 2, "input_ids", "[B, T]")
    elif attention_mask is None:
        raise ValueError("pass input_ids, or an attention_mask [B, T] describing a prompt given as model inputs")
    check_positive_int(max_new_tokens, "max_new_tokens")
    rule = rule or default_rule(sampling)
    to_probs = target_probs_fn(sampling, rule)
    stats = stats if stats is not None else SpecStats()
    device = (input_ids if input_ids is not None else attention_mask).device
    eos = [] if eos_token_id is None else \
        [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(token) for token in eos_token_id]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)

    with stats.phase("prefill"):
        out = target.prefill(input_ids, attention_mask, **model_inputs)
        stats.target_calls += 1
        probs = to_probs(out.logits[:, -1])
        rule.check_vocab(probs.shape[-1])
        batch = probs.shape[0]  # B rows (a guided target takes 2B prompt rows)
        pending = draw(probs, rule.greedy, generator=generator, name="target distribution")
    if drafter is not None:
        with stats.phase("draft"):
            calls = drafter.calls
            drafter.prefill(PrefillContext(input_ids, attention_mask, out, pending, model_inputs))
            stats.draft_calls += drafter.calls - calls  # a head's prefill forward drafts the first round's root

    output = _OutputBuffer(batch, max_new_tokens, eos, device)
    new_tokens, drafted = pending.unsqueeze(1), [0] * batch
    taken = output.append(new_tokens, drafted)
    if callback is not None:
        callback(*output.taken_tensors(new_tokens, drafted, taken))
    while not output.all_done():
        limit = output.draft_limit()
        if drafter is None or limit == 0:  # no drafts (or none any row could keep): one target token per row
            step = _target_only_round(target, pending, to_probs, rule, generator, stats)
        else:
            drafter.draft_limit = limit
            step = _speculative_round(target, drafter, pending, to_probs, rule, generator, stats)
        pending = step.next_tokens
        taken = output.append(step.tokens, step.accepted)
        stats.record_verification(step.accepted, step.checked, kept=taken)
        if callback is not None:
            callback(*output.taken_tensors(step.tokens, step.accepted, taken))
    if drafter is not None:
        drafter.draft_limit = None
    lengths = output.lengths
    stats.tokens += sum(lengths)
    return SpeculativeOutput(output.sequences(pad_token_id), torch.tensor(lengths, device=device),
                             output.drafted_mask(), stats)


class _Round(NamedTuple):
    """What a round produced, before the output cuts rows at their EOS / length limit."""

    tokens: torch.Tensor  # [B, M] each row's accepted drafts, then the target's token (-1 pad)
    accepted: list[int]  # accepted drafts per row (the first ones of its new tokens)
    checked: int | torch.Tensor  # draft positions checked along the accepted chain: K, or per-row tree depths
    next_tokens: torch.Tensor  # [B] the new pending token


def _target_only_round(target, pending, to_probs, rule, generator, stats) -> _Round:
    with stats.phase("target"):
        target.begin_round()
        out = target.forward(pending.unsqueeze(1))
        target.commit(torch.zeros_like(pending).unsqueeze(1))
        stats.target_calls += 1
    with stats.phase("verify"):
        probs = to_probs(out.logits[:, 0])
        next_tokens = draw(probs, rule.greedy, generator=generator, name="target distribution")
    return _Round(next_tokens.unsqueeze(1), [0] * pending.shape[0], 0, next_tokens)


def _speculative_round(target, drafter, pending, to_probs, rule, generator, stats) -> _Round:
    """One round: draft, score, verify, commit."""
    with stats.phase("draft"):
        calls = drafter.calls
        proposal = drafter.propose(pending)
    with stats.phase("target"):
        target.begin_round()
        if isinstance(proposal, DraftTree):
            out = target.forward(torch.cat([pending.unsqueeze(1), proposal.tokens], 1),
                                 offsets=tree_position_offsets(proposal.parents),
                                 attention=_tree_attention(target, proposal))
        else:
            out = target.forward(torch.cat([pending.unsqueeze(1), proposal.tokens], 1))
        stats.target_calls += 1
    with stats.phase("verify"), value_checks(False):  # softmax outputs: shapes are still checked
        probs = to_probs(out.logits)
        if isinstance(proposal, DraftTree):
            result = verify_tree(proposal, probs, rule, generator)
            counts = result.num_accepted.tolist()
            keep = torch.cat([torch.zeros_like(pending).unsqueeze(1),
                              torch.where(result.path >= 0, result.path + 1, -1)], 1)
            path, depth = result.path, proposal.depths().max(-1).values
        else:
            result = verify_tokens(proposal.tokens, proposal.probs, probs, rule, generator)
            counts = result.accepted_counts()
            path, depth = None, proposal.tokens.shape[1]
    with stats.phase("commit"):
        # a chain whose rows all kept as many drafts (every batch-1 round) keeps a prefix: slices, no masks
        prefix = counts[0] + 1 if path is None and min(counts) == max(counts) else None
        if prefix is not None:
            keep = torch.arange(prefix, device=pending.device).expand(len(counts), -1)
            committed = torch.cat([pending.unsqueeze(1), result.tokens[:, :prefix - 1]], 1)
            next_tokens = result.tokens[:, prefix - 1]
        else:
            if path is None:
                steps = torch.arange(proposal.tokens.shape[1] + 1, device=pending.device)
                keep = torch.where(steps <= result.num_accepted.unsqueeze(-1), steps, -1)
            committed = torch.cat([pending.unsqueeze(1), result.tokens[:, :-1]], 1)
            committed = torch.where(keep >= 0, committed, -1)
            next_tokens = result.tokens.gather(1, result.num_accepted.unsqueeze(1)).squeeze(1)
        hidden = _committed_rows(out.hidden, keep, prefix)
        penultimate = _committed_rows(getattr(out, "penultimate", None), keep, prefix)
        target.commit(keep)
    with stats.phase("draft"):
        drafter.commit(RoundResult(committed, result.num_accepted, next_tokens, hidden, path, probs, penultimate,
                                   accepted_counts=counts))
        stats.draft_calls += drafter.calls - calls
    return _Round(result.tokens, counts, depth, next_tokens)


def _committed_rows(values: torch.Tensor | None, keep: torch.Tensor, prefix: int | None = None
                    ) -> torch.Tensor | None:
    """``values [R, N+1, D]`` at the committed slots ``keep [B, M]`` (-1 pad reads slot 0); R is B, or 2B
    ``[cond; uncond]`` rows from ``GuidedRunner(hidden="both")``. ``prefix``: every row keeps its first
    ``prefix`` slots (a slice, no gather)."""
    if values is None:
        return None
    if prefix is not None:
        return values[:, :prefix]
    rows = keep.repeat(values.shape[0] // keep.shape[0], 1).clamp_min(0)
    return values.gather(1, rows.unsqueeze(-1).expand(-1, -1, values.shape[-1]))


def _tree_attention(target, tree: DraftTree) -> torch.Tensor:
    """Key visibility ``[B, N+1, S+N+1]``: all previous slots, then the tree's ancestor mask."""
    batch, nodes = tree.tokens.shape
    prefix = torch.ones(batch, nodes + 1, target.num_slots, dtype=torch.bool, device=tree.tokens.device)
    return torch.cat([prefix, tree_attention_mask(tree.parents)], dim=2)


class _OutputBuffer:
    """Per-row generated tokens with EOS / length stopping, kept on the host.

    A round adds a few tokens per row: reading them once (``tolist``) and extending Python lists costs two
    tensor operations a round, where doing the same on tensors cost about twenty, each several times its
    isolated time right after the target's forward. The tensors are built once, at the end.
    """

    def __init__(self, batch: int, max_new_tokens: int, eos: Iterable[int], device: torch.device) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.drafted: list[list[bool]] = [[] for _ in range(batch)]
        self.done = [False] * batch
        self.eos, self.max_new_tokens, self.device = frozenset(eos), max_new_tokens, device

    @property
    def lengths(self) -> list[int]:
        return [len(row) for row in self.tokens]

    def draft_limit(self) -> int:
        """Drafts a round may usefully propose: the most tokens an active row has left, minus the target's."""
        return max(self.max_new_tokens - len(row) for row, done in zip(self.tokens, self.done) if not done) - 1

    def append(self, new_tokens: torch.Tensor, num_drafted: list[int]) -> list[int]:
        """Append each row's new tokens up to its EOS / length limit; returns how many of each row's
        ``new_tokens [B, M]`` were taken (0 for rows that were already done).

        A row's new tokens are its leading non-negative entries, the first ``num_drafted[b]`` of them
        accepted drafts; it takes them up to its remaining room and up to (and including) its first EOS.
        """
        taken = []
        for b, (row, drafts) in enumerate(zip(new_tokens.tolist(), num_drafted)):
            count = 0
            if not self.done[b]:
                room = self.max_new_tokens - len(self.tokens[b])
                for token in row:
                    if token < 0 or count == room:
                        break
                    count += 1
                    if token in self.eos:
                        self.done[b] = True
                        break
                self.tokens[b].extend(row[:count])
                self.drafted[b].extend(i < drafts for i in range(count))
                self.done[b] = self.done[b] or len(self.tokens[b]) >= self.max_new_tokens
            taken.append(count)
        return taken

    @staticmethod
    def taken_tensors(new_tokens: torch.Tensor, num_drafted: list[int], taken: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`append` took, as ``(tokens [B, M] -1 pad, drafted [B, M])`` (a streaming callback's view)."""
        steps = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        limits = torch.tensor([taken, [min(n, t) for n, t in zip(num_drafted, taken)]], device=new_tokens.device)
        return torch.where(steps < limits[0].unsqueeze(1), new_tokens, -1), steps < limits[1].unsqueeze(1)

    def all_done(self) -> bool:
        return all(self.done)

    def sequences(self, pad_token_id: int) -> torch.Tensor:
        return self._padded(self.tokens, pad_token_id, torch.long)

    def drafted_mask(self) -> torch.Tensor:
        return self._padded(self.drafted, False, torch.bool)

    def _padded(self, rows: list[list], pad: int | bool, dtype: torch.dtype) -> torch.Tensor:
        width = max((len(row) for row in rows), default=0)
        return torch.tensor([row + [pad] * (width - len(row)) for row in rows], dtype=dtype,
                            device=self.device).reshape(len(rows), width)
