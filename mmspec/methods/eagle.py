"""EAGLE and LANTERN on discrete AR image models: an EAGLE head drafts chains, trees or blocks; LANTERN
accepts them with its relaxed rule over the codebook's nearest neighbours.

The pipeline provides the head(s) (``eagle_head``; ``eagle_block_head`` drafting K tokens per forward),
the transformer, ``grid_size`` and ``codebook_neighbors(k)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mmspec.drafters import TreeConfig
from mmspec.lookup_tail import LookupTailDrafter
from mmspec.methods.base import (
    BuildRequest,
    MethodConfig,
    MethodPlan,
    check_bool_field,
    check_choice_field,
    check_float_field,
    check_int_field,
    register,
)
from mmspec.rules import LANTERN_RESIDUALS, TREE_PATHS, LanternRule


@dataclass(frozen=True)
class EagleConfig(MethodConfig):
    """EAGLE drafting on an AR image model (lossless).

    Attributes:
        num_draft_tokens: chain length K (drafts per round; fewer where less is left to generate).
        tree: an EAGLE-2 dynamic tree instead of a chain (None: chain).
        draft_confidence_threshold: a round's chain stops before K once every row's drafted token had less
            than this probability under the head (0: always K). Lossless like any chain length.
        argmax_drafts: when sampling, draft the head's most likely token (point-mass proposals) instead of a
            sampled one; greedy decoding drafts argmax anyway.
        blocks: draft blocks of K tokens per head forward (with a head that has ``num_future`` > 1) or token
            by token; None: blocks for argmax chains of one image per call, tokens otherwise.
        guided: under classifier-free guidance, draft from the guided combination of both halves (True),
            the conditional half (False) or the target's guided features ("features", a head trained on them
            at this guidance scale); None picks "features" for such a head, else True for sampled drafts and
            False for argmax ones.
        lookup_tail: free drafts after every chain: this many tokens, each a copy of the token one grid row
            above it (0: none; chains only).
        lookup_only_from: with a lookup tail, a round whose tail has at least this many tokens skips the head
            and verifies the tail alone (one image per call). None: the head drafts every round.
    """

    lossless: ClassVar[bool] = True

    pipelines: ClassVar[tuple[str, ...]] = ("ar_image",)
    _nested_fields: ClassVar[dict[str, type]] = {"tree": TreeConfig}

    num_draft_tokens: int = 4
    tree: TreeConfig | None = None
    draft_confidence_threshold: float = 0.0
    argmax_drafts: bool = False
    blocks: bool | None = None
    guided: bool | str | None = None
    lookup_tail: int = 0
    lookup_only_from: int | None = None

    def validate(self) -> None:
        check_int_field(self, "num_draft_tokens", 1, 1024)
        if self.tree is not None and not isinstance(self.tree, TreeConfig):
            raise ValueError(f"{type(self).__name__}.tree must be a TreeConfig or None, got {self.tree!r}")
        check_float_field(self, "draft_confidence_threshold", 0.0, 1.0, high_open=True)
        check_bool_field(self, "argmax_drafts")
        check_bool_field(self, "blocks", optional=True)
        if self.guided not in (None, True, False, "features"):
            raise ValueError(f"{type(self).__name__}.guided must be None, True, False or 'features', got {self.guided!r}")
        check_int_field(self, "lookup_tail", 0, 1024)
        check_int_field(self, "lookup_only_from", 1, 1024, optional=True)
        if self.lookup_only_from is not None and not self.lookup_tail:
            raise ValueError(f"{type(self).__name__}.lookup_only_from skips the head in rounds with a long lookup "
                             "tail: set lookup_tail too")
        if self.lookup_tail and self.tree is not None:
            raise ValueError(f"{type(self).__name__}.lookup_tail extends draft chains: use tree=None (an EAGLE-2 tree "
                             "has no tail)")

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        return MethodPlan(drafter=eagle_drafter(self, pipeline, request))


@register("lantern")
@dataclass(frozen=True)
class LanternConfig(EagleConfig):
    """LANTERN / LANTERN++: EAGLE drafts accepted with a relaxed mass over the k nearest codebook entries
    (lossy: the accepted token may be a near neighbour of what the target would draw).

    Attributes (beyond :class:`EagleConfig`'s):
        k: neighbourhood size (None: min(1000, V - 1)).
        delta: LANTERN's total-variation budget in [0, 1] (0: exact sampling).
        lam: the LANTERN++ bound (> 1); when given, ``delta`` is ignored.
        residual_kind: what a rejection leaves to draw from: "tv" (the TV-optimal residual) or the released
            code's heuristics "zero_target_neighbors" / "zero_draft_neighbors" (see
            :class:`~mmspec.rules.LanternRule`).
        tree_path: how greedy decoding picks its path through an EAGLE-2 tree: "first_accepted" or
            "longest" (the released code's; see :attr:`~mmspec.rules.AcceptanceRule.tree_path`).
    """

    lossless: ClassVar[bool] = False

    k: int | None = None
    delta: float = 0.1
    lam: float | None = None
    residual_kind: str = "tv"
    tree_path: str = "first_accepted"

    def validate(self) -> None:
        super().validate()
        check_int_field(self, "k", 1, optional=True)
        check_float_field(self, "delta", 0.0, 1.0)
        check_float_field(self, "lam", 1.0, 1e6, low_open=True, optional=True)
        check_choice_field(self, "residual_kind", LANTERN_RESIDUALS)
        check_choice_field(self, "tree_path", TREE_PATHS)

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        vocab = int(pipeline.transformer.config.vocab_size)
        k = min(1000, vocab - 1) if self.k is None else self.k
        if k > vocab - 1:
            raise ValueError(f"LanternConfig.k must be at most the image vocabulary minus one ({vocab - 1}), got {k}")
        columns = k if self.residual_kind == "tv" else min(k + 1, vocab - 1)  # the released residual trims k + 1
        rule = LanternRule(pipeline.codebook_neighbors(columns), k=k, delta=self.delta, lam=self.lam,
                           greedy=request.greedy, residual_kind=self.residual_kind, tree_path=self.tree_path)
        return MethodPlan(drafter=eagle_drafter(self, pipeline, request), rule=rule)


register("eagle", EagleConfig)


def eagle_drafter(config: EagleConfig, pipeline: Any, request: BuildRequest) -> Any:
    """The EAGLE drafter of ``config`` on ``pipeline``'s head (chain, tree or blocks; a lookup tail)."""
    from mmspec.models.eagle import EagleDrafter

    deterministic = request.greedy or config.argmax_drafts
    blocks = (deterministic and config.tree is None and request.batch_size == 1) if config.blocks is None \
        else config.blocks
    head = drafting_head(pipeline, blocks)
    mode = guidance_mode(head, config.guided, request.guidance_scale, deterministic)
    drafter: Any = EagleDrafter(head, config.num_draft_tokens, sampling=request.sampling, tree=config.tree,
                                generator=request.generator,
                                guidance_scale=request.guidance_scale if mode is True else 1.0,
                                confidence_threshold=config.draft_confidence_threshold,
                                guided_features=mode == "features", blocks=blocks, argmax_drafts=config.argmax_drafts)
    if config.lookup_tail:
        drafter = LookupTailDrafter(drafter, config.lookup_tail, offset=pipeline.grid_size,
                                    vocab_size=int(pipeline.transformer.config.vocab_size),
                                    lookup_only_from=config.lookup_only_from,
                                    max_length=pipeline.transformer.config.block_size)
    return drafter


def drafting_head(pipeline: Any, blocks: bool) -> Any:
    """The head that drafts: the pipeline's ``eagle_block_head`` for blocks when it has one, else its
    ``eagle_head`` (itself drafting blocks if it has ``num_future`` > 1)."""
    if pipeline.eagle_head is None and pipeline.eagle_block_head is None:
        raise ValueError("EAGLE drafting needs an eagle_head; this pipeline has none")
    if blocks and pipeline.eagle_block_head is not None:
        return pipeline.eagle_block_head
    if pipeline.eagle_head is None:
        raise ValueError("token-by-token EAGLE drafting (sampling, blocks=False or a tree) needs an eagle_head; "
                         "this pipeline has only an eagle_block_head")
    return pipeline.eagle_head


def guidance_mode(head: Any, guided: bool | str | None, guidance_scale: float, deterministic: bool) -> bool | str:
    """How the head drafts under guidance: "features" (one row of guided features, for a head trained on them
    at this scale), True (both halves, logits combined) or False (the conditional half). ``deterministic``:
    the chain drafts argmax tokens, whose acceptance the head's unconditional errors (amplified by s - 1)
    would cost, so auto mode drafts them from the conditional half."""
    trained_scale = head.config.get("feature_guidance")  # None: trained on plain features
    fits = guidance_scale != 1.0 and trained_scale == guidance_scale
    if guided is None:
        return "features" if fits else not deterministic
    if guided == "features" and not fits:
        raise ValueError(f"guided='features' needs a head trained on guided features at this guidance_scale "
                         f"({guidance_scale}); this head's feature_guidance is {trained_scale}")
    return guided
