"""mmspec: speculative decoding for multimodal and visual-generation models.

The core (this package) holds every accept/reject decision of the project: sampling utilities,
acceptance rules, chain/tree/local-2-D/continuous verification, reward routing, KV-cache rollback,
speculation statistics, the speculation loop and the kernels. Pipelines (``mmspec.pipelines``) and
models (``mmspec.models``) build on it; importing ``mmspec`` imports neither them nor any optional
dependency (triton, open_clip, gradio, ...).
"""

from importlib import import_module
from typing import Any

from mmspec.cache import KVCache, SlotState, crop_cache, select_cache_slots
from mmspec.continuous import ContinuousVerification, cspd_log_ratio, cspd_log_ratio_terms, verify_continuous
from mmspec.local2d import LocalVerification, local_resample_sets
from mmspec.reward import RewardRouter, RouteDecision
from mmspec.rules import (
    AcceptanceRule,
    ExactRule,
    GreedyRule,
    GroupedRule,
    LanternRule,
    PoolingThresholdRule,
)
from mmspec.sampling import SamplingConfig, apply_guidance, logits_to_probs, sample
from mmspec.stats import SpecStats
from mmspec.tree import (
    DraftTree,
    TreeVerification,
    expand_dynamic_tree,
    static_tree_from_choices,
    tree_attention_mask,
    verify_tree,
)
from mmspec.verify import Verification, verify_tokens

__version__ = "0.1.0"

# Pipelines are exported lazily so `import mmspec` stays light (no diffusers import until used).
_LAZY = {
    "VLMPipeline": "mmspec.pipelines",
    "ARImagePipeline": "mmspec.pipelines",
    "ContinuousARImagePipeline": "mmspec.pipelines",
    "ARVideoPipeline": "mmspec.pipelines",
    "speculative_generate": "mmspec.speculate",
    "local_speculative_generate": "mmspec.local_speculate",
    "RowBlockDrafter": "mmspec.local_speculate",
    "ModelDrafter": "mmspec.drafters",
    "TreeConfig": "mmspec.drafters",
    "JacobiDrafter": "mmspec.drafters",
    "CausalLMRunner": "mmspec.runner",
    "speculative_custom_generate": "mmspec.transformers_generate",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = import_module(_LAZY[name])
        if not hasattr(module, name):
            raise AttributeError(f"mmspec.{name} is not available in this version ({_LAZY[name]} does not define it)")
        return getattr(module, name)
    raise AttributeError(f"module 'mmspec' has no attribute {name!r}")


__all__ = [
    "AcceptanceRule", "ContinuousVerification", "DraftTree", "ExactRule", "GreedyRule", "GroupedRule",
    "KVCache", "LanternRule", "LocalVerification", "PoolingThresholdRule", "RewardRouter", "RouteDecision",
    "SamplingConfig", "SlotState", "SpecStats", "TreeVerification", "Verification", "apply_guidance",
    "crop_cache", "cspd_log_ratio", "cspd_log_ratio_terms", "expand_dynamic_tree", "local_resample_sets", "logits_to_probs", "sample",
    "select_cache_slots", "static_tree_from_choices", "tree_attention_mask", "verify_continuous",
    "verify_tokens", "verify_tree", "speculative_generate", "ModelDrafter", "JacobiDrafter", "TreeConfig",
    "CausalLMRunner", "local_speculative_generate", "RowBlockDrafter", "speculative_custom_generate",
]
