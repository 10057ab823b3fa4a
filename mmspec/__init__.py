"""mmspec: speculative decoding for multimodal and visual-generation models.

The core (this package) holds every accept/reject decision of the project: sampling utilities,
acceptance rules, chain/tree/local-2-D/continuous verification, reward routing, KV-cache rollback,
speculation statistics, the speculation loop and the kernels. Pipelines (``mmspec.pipelines``) and
models (``mmspec.models``) build on it; importing ``mmspec`` imports neither them nor any optional
dependency (triton, open_clip, gradio, ...).
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# Every public name is imported on first use, so `import mmspec` (and `mmspec --version`) costs nothing: torch
# and the modules below load only when a name from them is asked for.
_LAZY = {
    **dict.fromkeys(("KVCache", "SlotState", "crop_cache", "select_cache_slots"), "mmspec.cache"),
    **dict.fromkeys(("ContinuousVerification", "cspd_log_ratio", "cspd_log_ratio_terms", "verify_continuous"),
                    "mmspec.continuous"),
    **dict.fromkeys(("LocalVerification", "local_resample_sets"), "mmspec.local2d"),
    **dict.fromkeys(("RewardRouter", "RouteDecision"), "mmspec.reward"),
    **dict.fromkeys(("AcceptanceRule", "ExactRule", "GreedyRule", "GroupedRule", "LanternRule",
                     "PoolingThresholdRule"), "mmspec.rules"),
    **dict.fromkeys(("SamplingConfig", "apply_guidance", "logits_to_probs", "sample"), "mmspec.sampling"),
    "SpecStats": "mmspec.stats",
    **dict.fromkeys(("DraftTree", "TreeVerification", "expand_dynamic_tree", "static_tree_from_choices",
                     "tree_attention_mask", "verify_tree"), "mmspec.tree"),
    **dict.fromkeys(("Verification", "verify_tokens"), "mmspec.verify"),
    # Pipelines: no diffusers import until one is used.
    **dict.fromkeys(("VLMPipeline", "ARImagePipeline", "ContinuousARImagePipeline", "ARVideoPipeline"),
                    "mmspec.pipelines"),
    "speculative_generate": "mmspec.speculate",
    "local_speculative_generate": "mmspec.local_speculate",
    "RowBlockDrafter": "mmspec.local_speculate",
    "ModelDrafter": "mmspec.drafters",
    "TreeConfig": "mmspec.drafters",
    "JacobiDrafter": "mmspec.drafters",
    "CausalLMRunner": "mmspec.runner",
    "speculative_custom_generate": "mmspec.transformers_generate",
}


# diffusers.DiffusionPipeline.from_pretrained(saved_folder) finds the pipeline classes after `import mmspec` alone
# (without importing diffusers or torch here): mmspec/diffusers_hook.py
import_module("mmspec.diffusers_hook").install()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = import_module(_LAZY[name])
        if not hasattr(module, name):
            raise AttributeError(f"mmspec.{name} is not available in this version ({_LAZY[name]} does not define it)")
        return getattr(module, name)
    raise AttributeError(f"module 'mmspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "AcceptanceRule", "ContinuousVerification", "DraftTree", "ExactRule", "GreedyRule", "GroupedRule",
    "KVCache", "LanternRule", "LocalVerification", "PoolingThresholdRule", "RewardRouter", "RouteDecision",
    "SamplingConfig", "SlotState", "SpecStats", "TreeVerification", "Verification", "apply_guidance",
    "crop_cache", "cspd_log_ratio", "cspd_log_ratio_terms", "expand_dynamic_tree", "local_resample_sets", "logits_to_probs", "sample",
    "select_cache_slots", "static_tree_from_choices", "tree_attention_mask", "verify_continuous",
    "verify_tokens", "verify_tree", "speculative_generate", "ModelDrafter", "JacobiDrafter", "TreeConfig",
    "CausalLMRunner", "local_speculative_generate", "RowBlockDrafter", "speculative_custom_generate",
]
