"""The VLM methods: a draft head (EAGLE, FLASH, ViSpec, SpecVLM) or a standalone draft VLM proposes text
tokens; the target VLM verifies them exactly (every one is lossless).

All five share their settings (:class:`VLMDraftConfig`: chain length, an optional EAGLE-2 tree, a
confidence cut-off) and differ in the pipeline component that holds their draft model and in how that
model becomes a drafter. The pipeline (:class:`~mmspec.pipelines.vlm.VLMPipeline`) provides the
components ``eagle_head``, ``flash_head``, ``vispec_head``, ``specvlm_head`` and ``draft_model``.

Besides :meth:`~mmspec.methods.MethodConfig.build`, a VLM config tells the pipeline three things as class
attributes: which component holds its draft model (:attr:`VLMDraftConfig.component`, whose
``max_position_embeddings`` bounds the context as the target's does), whether that drafter reads the whole
image span (:attr:`VLMDraftConfig.reads_whole_image`, reported as ``draft_visual_tokens``) and whether it
needs the target's penultimate hidden states (:attr:`VLMDraftConfig.needs_penultimate`, SpecVLM's gate). A
config registered from outside the package may declare none of them (:func:`draft_component` and the
pipeline read them with defaults).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mmspec.drafters import TreeConfig
from mmspec.methods.base import (
    BuildRequest,
    MethodConfig,
    MethodPlan,
    check_float_field,
    check_int_field,
    get,
    register,
)

FAMILY = "vlm"


@dataclass(frozen=True)
class VLMDraftConfig(MethodConfig):
    """Settings shared by every VLM drafting method (lossless whatever their values: they change speed only).

    Attributes:
        num_draft_tokens: chain length K, drafts per round (FLASH: its semi-autoregressive head drafts
            ``num_future`` of them per forward).
        tree: an EAGLE-2 dynamic tree instead of a chain (None: chain), for drafters that support one.
        draft_confidence_threshold: dynamic chain length in [0, 1): a round's chain stops before K once
            every row's last draft had less than this probability under the drafter (FLASH: its block is cut
            there and no further forward runs); 0 always drafts K. Chains only (a tree is dynamic already).
    """

    lossless: ClassVar[bool] = True

    pipelines: ClassVar[tuple[str, ...]] = (FAMILY,)
    _nested_fields: ClassVar[dict[str, type]] = {"tree": TreeConfig}
    #: the pipeline component that holds the draft model (its position limit bounds the context)
    component: ClassVar[str] = ""
    #: whether the drafter can draft an EAGLE-2 tree
    supports_tree: ClassVar[bool] = True
    #: whether the drafter attends to the whole image span (reported when it does not count its own)
    reads_whole_image: ClassVar[bool] = False
    #: whether the drafter reads the target's penultimate hidden states
    needs_penultimate: ClassVar[bool] = False

    num_draft_tokens: int = 6
    tree: TreeConfig | None = None
    draft_confidence_threshold: float = 0.0

    def validate(self) -> None:
        owner = type(self).__name__
        check_int_field(self, "num_draft_tokens", 1, 1024)
        if self.tree is not None and not isinstance(self.tree, TreeConfig):
            raise ValueError(f"{owner}.tree must be a TreeConfig or None, got {self.tree!r}")
        if self.tree is not None and not self.supports_tree:
            raise ValueError(f"{owner}.tree must be None: this method drafts chains only (no EAGLE-2 trees)")
        check_float_field(self, "draft_confidence_threshold", 0.0, 1.0, high_open=True)
        if self.tree is not None and self.draft_confidence_threshold > 0:
            raise ValueError(f"{owner}.draft_confidence_threshold sets the length of draft chains, and an EAGLE-2 "
                             "tree is dynamic already: set tree=None or draft_confidence_threshold=0")

    def build(self, pipeline: Any, request: BuildRequest) -> MethodPlan:
        return MethodPlan(drafter=self.drafter(self.draft_model(pipeline), request))

    def draft_model(self, pipeline: Any) -> Any:
        """The pipeline's :attr:`component` (``ValueError`` naming it when the pipeline has none)."""
        model = getattr(pipeline, self.component, None)
        if model is None:
            raise ValueError(f"method={self.name!r} needs a {self.component}; this pipeline has none")
        return model

    def drafter(self, model: Any, request: BuildRequest) -> Any:
        """The drafter of a draft head: the head's own VLM drafter, or EAGLE's for a plain EAGLE head."""
        from mmspec.models.eagle import EagleDrafter, EagleHead
        from mmspec.models.vlm_drafters import VLMDraftHead, drafter_for

        options = self._drafter_options(request)
        if isinstance(model, VLMDraftHead):
            return drafter_for(model, num_draft_tokens=self.num_draft_tokens, **options)
        if isinstance(model, EagleHead):
            return EagleDrafter(model, self.num_draft_tokens, **options)
        raise ValueError(f"{self.component} is a {type(model).__name__}, not a draft head "
                         "(mmspec.models.vlm_drafters or EagleHead)")

    def _drafter_options(self, request: BuildRequest) -> dict[str, Any]:
        return {"sampling": request.sampling, "tree": self.tree, "generator": request.generator,
                "confidence_threshold": self.draft_confidence_threshold}


@register("eagle")
@dataclass(frozen=True)
class VLMEagleConfig(VLMDraftConfig):
    """EAGLE on a VLM: an EagleVLM head (or a plain EAGLE head) over the target's features; chain or tree."""

    component: ClassVar[str] = "eagle_head"
    reads_whole_image: ClassVar[bool] = True


@register("flash")
@dataclass(frozen=True)
class FlashConfig(VLMDraftConfig):
    """FLASH: latent-compressed image span and a semi-autoregressive head (several drafts per forward;
    chains only)."""

    component: ClassVar[str] = "flash_head"
    supports_tree: ClassVar[bool] = False


@register("vispec")
@dataclass(frozen=True)
class ViSpecConfig(VLMDraftConfig):
    """ViSpec: a vision adaptor (a few image tokens and a global vector) on the draft head."""

    component: ClassVar[str] = "vispec_head"


@register("specvlm")
@dataclass(frozen=True)
class SpecVLMConfig(VLMDraftConfig):
    """SpecVLM: an elastic visual compressor chosen per input by a gate on the target's penultimate states."""

    component: ClassVar[str] = "specvlm_head"
    needs_penultimate: ClassVar[bool] = True


@register("draft_vlm")
@dataclass(frozen=True)
class DraftVLMConfig(VLMDraftConfig):
    """A standalone small VLM of the target's family and tokenizer drafts (classic speculative decoding)."""

    component: ClassVar[str] = "draft_model"
    reads_whole_image: ClassVar[bool] = True

    def drafter(self, model: Any, request: BuildRequest) -> Any:
        return model_drafter(self, model, request)


def model_drafter(config: VLMDraftConfig, model: Any, request: BuildRequest) -> Any:
    """A standalone draft model (a transformers VLM, or a causal LM for a text-only target) drafting with
    ``config``'s chain length, tree and confidence cut-off."""
    from mmspec.drafters import ModelDrafter
    from mmspec.models.vlm_targets import VLMRunner, vlm_family
    from mmspec.runner import CausalLMRunner

    try:
        vlm_family(model)
        runner: Any = VLMRunner(model)
    except ValueError:
        runner = CausalLMRunner(model)
    return ModelDrafter(runner, config.num_draft_tokens, **config._drafter_options(request))


def bind_head(head: Any, target: Any) -> None:
    """Bind a draft head to the target's embedding and LM head (a VLM head takes the model, an EAGLE head the
    two modules), with the head's own size checks."""
    try:
        head.bind_target(target)
    except (TypeError, AttributeError):
        head.bind_target(target.get_input_embeddings(), target.get_output_embeddings())


def draft_component(method: str | MethodConfig | None) -> str | None:
    """The pipeline component holding the draft model of ``method`` (a VLM method name or config): None for
    target-only decoding ("none" or None) and for a method that declares no component."""
    if method is None or method == "none":
        return None
    config_class = get(method, FAMILY) if isinstance(method, str) else type(method)
    return getattr(config_class, "component", None) or None
