"""Speculative decoding from transformers' own ``model.generate()``: an mmspec draft head (or a small draft model)
as a ``custom_generate`` decoding method.

transformers hands a callable ``custom_generate`` everything its ``generate()`` prepared (the prompt, the
generation config, the logits processors, the streamer, the model inputs) and returns what it returns. This
one runs the core's :func:`~mmspec.speculate.speculative_generate` with the given draft instead of
transformers' sampling loop::

    from mmspec import speculative_custom_generate

    out = target.generate(**inputs, max_new_tokens=128, do_sample=False,
                          custom_generate=speculative_custom_generate, draft_model=pipe.flash_head)

``draft_model`` is an mmspec draft head (:mod:`mmspec.models.vlm_drafters`, :class:`~mmspec.models.eagle.EagleHead`;
bound to the target here) or a transformers model with the target's tokenizer; ``draft_config`` optionally
sets the chain length, a tree or a confidence cut-off (a :class:`~mmspec.methods.vlm_heads.VLMDraftConfig`,
default six drafts per round). Greedy output equals plain ``generate()`` token for token, sampled output
follows the same distribution (exact speculative sampling). What the loop cannot reproduce exactly (logits
processors other than temperature, top-k and top-p; stopping criteria other than the length and EOS; beam
search) is refused with an error naming it rather than ignored.

Streaming: ``generate()`` does not hand its ``streamer=`` to a callable ``custom_generate`` (it only sends it
the prompt), so pass the streamer as ``speculative_streamer=`` instead; it gets the prompt first, then the
verified tokens of every round, then ``end()``, as transformers' own loops do (so ``skip_prompt=True`` works).
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec.methods.base import BuildRequest
from mmspec.runner import CausalLMRunner
from mmspec.sampling import SamplingConfig
from mmspec.speculate import speculative_generate
from mmspec.validation import check_position_limits, max_position_embeddings

#: the processors and criteria ``generate()`` builds from the settings the core's sampling reproduces
_SAMPLING_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")
_STOPPING_CRITERIA = ("MaxLengthCriteria", "EosTokenCriteria")
#: model inputs that steer transformers' own loop; the core's runners manage their caches themselves
_LOOP_STATE = ("use_cache", "past_key_values", "cache_position", "position_ids", "output_attentions",
               "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate", "logits_to_keep")


def speculative_custom_generate(model: Any, input_ids: torch.LongTensor, logits_processor: Any = None,
                                stopping_criteria: Any = None, generation_config: Any = None,
                                synced_gpus: bool = False, streamer: Any = None, *, draft_model: Any = None,
                                draft_config: Any = None, speculative_streamer: Any = None,
                                **model_kwargs: Any) -> Any:
    """``model.generate(..., custom_generate=speculative_custom_generate, draft_model=...)``: see the module
    docstring. Returns the prompt followed by the generated tokens ``[B, T + L]`` (rows that stopped early
    padded with the pad token), or a ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate=True``."""
    _check_draft_model(draft_model)
    if synced_gpus:
        raise NotImplementedError("speculative_custom_generate runs on one device: synced_gpus is not supported")
    config = generation_config
    if getattr(config, "num_beams", 1) != 1:
        raise ValueError(f"speculative_custom_generate decodes one sequence per row: num_beams must be 1, got "
                         f"{config.num_beams}")
    _check_supported("logits processor", logits_processor, _SAMPLING_PROCESSORS)
    _check_supported("stopping criterion", stopping_criteria, _STOPPING_CRITERIA)
    sampling = SamplingConfig(do_sample=bool(config.do_sample), temperature=float(config.temperature or 1.0),
                              top_k=config.top_k or None, top_p=float(config.top_p or 1.0))
    max_new_tokens = config.max_new_tokens or (config.max_length - input_ids.shape[1])
    if max_new_tokens < 1:
        raise ValueError(f"nothing to generate: max_length={config.max_length} is not above the prompt's "
                         f"{input_ids.shape[1]} tokens")
    attention_mask = model_kwargs.get("attention_mask")
    prompt = int(attention_mask.sum(-1).max()) if attention_mask is not None else int(input_ids.shape[1])
    limits = {"target": max_position_embeddings(model), "draft_model": max_position_embeddings(draft_model)}
    check_position_limits(prompt, max_new_tokens, {name: limit for name, limit in limits.items() if limit})
    eos = _token_list(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)

    streamer = speculative_streamer if speculative_streamer is not None else streamer
    target, drafter = _target_and_drafter(model, draft_model, draft_config, sampling, input_ids.shape[0])
    inputs = {key: value for key, value in model_kwargs.items() if key not in _LOOP_STATE}
    attention_mask = inputs.pop("attention_mask", None)
    if streamer is not None:
        streamer.put(input_ids.cpu())  # the prompt first, as transformers' loops do (skip_prompt relies on it)

    def on_round(new_tokens: torch.Tensor, drafted: torch.Tensor) -> None:
        if streamer is not None:
            streamer.put(new_tokens[0][new_tokens[0] >= 0].cpu())

    out = speculative_generate(target, drafter, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                               sampling=sampling, eos_token_id=eos or None, pad_token_id=int(pad),
                               callback=on_round if streamer is not None else None, **inputs)
    if streamer is not None:
        streamer.end()
    generated = out.sequences.clone()
    positions = torch.arange(generated.shape[1], device=generated.device)
    generated[positions[None, :] >= out.lengths[:, None]] = int(pad)
    sequences = torch.cat([input_ids, generated.to(input_ids.device)], dim=1)
    if config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _target_and_drafter(model: Any, draft_model: Any, draft_config: Any, sampling: SamplingConfig,
                        batch_size: int) -> tuple[Any, Any]:
    """The target runner over ``model`` and the drafter of ``draft_model`` (heads are bound to ``model``)."""
    from mmspec.methods.vlm_heads import DraftVLMConfig, VLMDraftConfig, bind_head, model_drafter
    from mmspec.models.vlm_targets import VLMRunner, vlm_family

    is_head = hasattr(draft_model, "bind_target")
    if draft_config is None:
        draft_config = VLMDraftConfig() if is_head else DraftVLMConfig()
    elif not isinstance(draft_config, VLMDraftConfig):
        raise ValueError(f"draft_config must be a VLMDraftConfig (mmspec.methods.vlm_heads), got "
                         f"{type(draft_config).__name__}")
    try:
        vlm_family(model)
        is_vlm = True
    except ValueError:
        is_vlm = False
    request = BuildRequest(sampling, batch_size=batch_size)
    if is_head:
        bind_head(draft_model, model)
        drafter = draft_config.drafter(draft_model, request)
    else:
        draft_vocab = draft_model.get_output_embeddings().weight.shape[0]
        vocab = model.get_output_embeddings().weight.shape[0]
        if draft_vocab != vocab:
            raise ValueError(f"draft_model predicts {draft_vocab} tokens, the target {vocab}: they must share a "
                             "tokenizer")
        drafter = model_drafter(draft_config, draft_model, request)
    hidden = drafter.needs_target_hidden
    if is_vlm:
        penultimate = bool(getattr(draft_config, "needs_penultimate", False))
        return VLMRunner(model, return_hidden=hidden, return_penultimate=penultimate), drafter
    return CausalLMRunner(model, return_hidden=hidden), drafter


def _check_draft_model(draft_model: Any) -> None:
    """``draft_model`` is a draft head (a module with ``bind_target``) or a transformers model (a module with
    output embeddings to compare vocabularies), checked before anything runs."""
    what = ("an mmspec draft head (mmspec.models.vlm_drafters, EagleHead) or a small transformers model with the "
            "target's tokenizer")
    if draft_model is None:
        raise ValueError(f"speculative_custom_generate needs draft_model=: {what}")
    if not isinstance(draft_model, torch.nn.Module) or not (
            hasattr(draft_model, "bind_target") or callable(getattr(draft_model, "get_output_embeddings", None))):
        raise TypeError(f"draft_model must be {what}, got {type(draft_model).__name__} {draft_model!r:.60}")


def _check_supported(kind: str, items: Any, supported: tuple[str, ...]) -> None:
    for item in items or ():
        name = type(item).__name__
        if name not in supported:
            raise ValueError(f"speculative_custom_generate cannot apply the {kind} {name} exactly (supported: "
                             f"{', '.join(supported)}); remove the setting that adds it")


def _token_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
