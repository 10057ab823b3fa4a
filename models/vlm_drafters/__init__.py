"""Draft heads for vision-language targets: EagleVLM, FLASH, ViSpec and SpecVLM.

Each method is a model (``diffusers`` ``ModelMixin`` + ``ConfigMixin``: an EAGLE-style head plus its view of
the prompt's image span, saved with ``save_pretrained``) and a drafter for :func:`mmspec.speculative_generate`
on a :class:`~mmspec.models.vlm_targets.VLMRunner` target. Training (online-logit distillation) lives with the
recipes: :mod:`mmspec.models.recipes.vlm_drafter_loss`. See docs/models_vlm_drafters.md.

This package is the component library a pipeline's ``model_index.json`` names for the heads
(``["mmspec.models.vlm_drafters", "FlashHead"]``): diffusers' loader looks a component's class *and* the loadable
base class it derives from (``ModelMixin``) up on the library it names, so the package exports both.
"""

from diffusers import ModelMixin

from .base import (
    DraftSequence,
    HeadRunner,
    SpanUnits,
    VisualView,
    VLMDraftHead,
    VLMFeatures,
    VLMHeadDrafter,
    assemble_units,
)
from .eagle_vlm import EagleVLMDrafter, EagleVLMHead
from .flash import FlashDrafter, FlashHead
from .specvlm import PRIMITIVES, SpecVLMDrafter, SpecVLMHead
from .vispec import ViSpecDrafter, ViSpecHead

#: model class -> its drafter class
DRAFTERS: dict[type[VLMDraftHead], type[VLMHeadDrafter]] = {
    EagleVLMHead: EagleVLMDrafter, FlashHead: FlashDrafter, ViSpecHead: ViSpecDrafter, SpecVLMHead: SpecVLMDrafter}


def drafter_for(model: VLMDraftHead, **kwargs) -> VLMHeadDrafter:
    """The drafter of ``model``'s method, e.g. ``drafter_for(flash_head, sampling=cfg)`` -> :class:`FlashDrafter`."""
    for cls in type(model).__mro__:
        if cls in DRAFTERS:
            return DRAFTERS[cls](model, **kwargs)
    raise ValueError(f"no drafter for {type(model).__name__}; expected one of {', '.join(c.__name__ for c in DRAFTERS)}")


__all__ = [
    "DRAFTERS", "DraftSequence", "EagleVLMDrafter", "EagleVLMHead", "FlashDrafter", "FlashHead", "HeadRunner",
    "ModelMixin",
    "PRIMITIVES", "SpanUnits", "SpecVLMDrafter", "SpecVLMHead", "ViSpecDrafter", "ViSpecHead", "VLMDraftHead",
    "VLMFeatures", "VLMHeadDrafter", "VisualView", "assemble_units", "drafter_for",
]
