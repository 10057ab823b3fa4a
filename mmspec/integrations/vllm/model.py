"""``EagleMmspecHeadForCausalLM``: mmspec's EAGLE head as a vLLM model (imported by vLLM only, through the plugin).

The math is :class:`mmspec.models.eagle.EagleHead`'s, on vLLM's layers::

    x = fc( RMSNorm_2d([embed(token) ; h]) )      # RMSNorm_2d only where the head has an input norm
    x = LlamaDecoderLayer(x)                      # with its input RMSNorm (vLLM's EAGLE-1 drops it)
    h' = RMSNorm(x)                               # the predicted feature: read by the target's LM head
                                                  # and fed back as the next draft step's h

The embedding and the LM head are the target's: vLLM's EAGLE proposer shares them when the checkpoint has
none, as an exported head never does. Heads exported with their image view (EagleVLM) accept the target's
multimodal embeddings, which vLLM's proposer then merges at image placeholders (shifted one slot, as EAGLE
pairs are), the draft units EagleVLM reads.
"""

# no `from __future__ import annotations`: vLLM's support_torch_compile reads the forward's annotations at runtime
from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM, LlamaDecoderLayer
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    WeightsMapper,
    _merge_multimodal_embeddings,
    get_draft_quant_config,
    maybe_prefix,
)

from .checkpoints import EXPORT_FORMAT


def _mmspec_section(config: object) -> dict:
    section = getattr(config, "mmspec", None)
    if not isinstance(section, dict) or section.get("format") != EXPORT_FORMAT:
        raise ValueError("EagleMmspecHeadForCausalLM needs a head written by mmspec.integrations.vllm.export_head "
                         f"(config.json section 'mmspec', format {EXPORT_FORMAT}); got {section!r}")
    return section


@support_torch_compile
class MmspecEagleModel(nn.Module):
    """fc (+ input norm), one Llama decoder layer with its input norm, final norm."""

    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            ".gate_proj": (".gate_up_proj", 0),
            ".up_proj": (".gate_up_proj", 1),
        }
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", start_layer_id: int = 0) -> None:
        super().__init__()
        config = vllm_config.speculative_config.draft_model_config.hf_config
        section = _mmspec_section(config)
        self.config = config
        width = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, width, prefix=maybe_prefix(prefix, "embed_tokens"))
        self.fused_norm = RMSNorm(2 * width, eps=config.rms_norm_eps) if section["input_norm"] else None
        self.fc = ReplicatedLinear(input_size=2 * width, output_size=width, bias=bool(section["fc_bias"]),
                                   params_dtype=vllm_config.model_config.dtype,
                                   quant_config=get_draft_quant_config(vllm_config),
                                   prefix=maybe_prefix(prefix, "fc"), return_bias=False)
        self.layers = nn.ModuleList([
            LlamaDecoderLayer(vllm_config, False, prefix=maybe_prefix(prefix, f"layers.{i + start_layer_id}"),
                              config=config)
            for i in range(config.num_hidden_layers)
        ])
        self.norm = RMSNorm(width, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        fused = torch.cat((inputs_embeds, hidden_states), dim=-1)
        if self.fused_norm is not None:
            fused = self.fused_norm(fused)
        x = self.fc(fused)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        features, _ = self.norm(x, residual)
        return features, features

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)


class EagleMmspecHeadForCausalLM(EagleLlamaForCausalLM):
    """vLLM model class of an exported mmspec head (``speculative_config={"method": "eagle", "model": FOLDER}``)."""

    supports_multimodal_embeddings = True  # per instance: False for heads exported without their image view

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.config = vllm_config.speculative_config.draft_model_config.hf_config
        section = _mmspec_section(self.config)
        if getattr(self.config, "draft_vocab_size", None) is None:
            self.config.draft_vocab_size = self.config.vocab_size
        self.supports_multimodal_embeddings = bool(section["multimodal_embeddings"])
        target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.model = MmspecEagleModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                      start_layer_id=target_layers)
        self.logits_processor = LogitsProcessor(self.config.vocab_size, scale=1.0)

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings: object = None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings (the target's), with the target's image embeddings merged at ``is_multimodal``."""
        embeds = self.model.embed_input_ids(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return embeds
        return _merge_multimodal_embeddings(embeds, multimodal_embeddings, is_multimodal)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, hidden_states, inputs_embeds)
