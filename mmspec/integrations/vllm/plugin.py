"""mmspec's vLLM plugin (entry point ``vllm.general_plugins``, declared in pyproject.toml).

vLLM calls :func:`register` in every process it starts, before it builds a model. It registers the one
architecture vLLM lacks, ``EagleMmspecHeadForCausalLM`` (:mod:`.model`), lazily by name so that loading the
plugin imports neither torch's model code nor mmspec's pipelines, and on the CPU build corrects the one
kernel that breaks sampled speculative decoding there (:mod:`.cpu_fixes`).
"""

from __future__ import annotations

from .checkpoints import EXPORTED_ARCHITECTURE

MODEL_CLASS = "mmspec.integrations.vllm.model:EagleMmspecHeadForCausalLM"


def register() -> None:
    """Register mmspec's head architecture with vLLM's model registry and apply :func:`.cpu_fixes.apply`
    (safe to call more than once)."""
    from vllm import ModelRegistry

    from . import cpu_fixes

    if EXPORTED_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(EXPORTED_ARCHITECTURE, MODEL_CLASS)
    cpu_fixes.apply()
