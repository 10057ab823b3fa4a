"""transformers VLMs (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL) as speculative-decoding targets.

:class:`VLMRunner` extends :class:`~mmspec.runner.CausalLMRunner` (the target interface of
:func:`mmspec.speculate.speculative_generate`) to multimodal prompts:

* **Prefill** runs the prompt with its images (``pixel_values``; ``image_sizes`` for LLaVA-NeXT;
  ``image_grid_thw`` / ``mm_token_type_ids`` and optionally videos for Qwen) through the HF model itself;
  every later call is text only (decode steps, draft chains, draft trees) and reuses the KV cache, which
  the core rolls back per row (``commit``).
* **Positions.** LLaVA and LLaVA-NeXT use ordinary 1-D positions (the core's per-row slot positions).
  Qwen2-VL and Qwen2.5-VL use M-RoPE: three position axes (temporal, height, width). The prompt's
  positions come from the model's own ``get_rope_index`` (image tokens get a 2-D grid, text a diagonal),
  which also gives one *rope delta* per row (``max prompt position + 1 - valid prompt tokens``). After the prompt every token
  is text, so a slot at text position ``p`` (the core's per-row counter, padding excluded) sits at
  ``p + delta`` on all three axes; a tree node at depth ``k`` below the root at text position ``p`` sits at
  ``p + k + delta`` on all three axes. This is what transformers' own incremental decoding computes
  (``compute_3d_position_ids`` with a cache), generalised to per-row slot layouts and trees.
* **What drafters need** (:class:`VLMPrefillOutput`, the ``context.target`` a drafter's ``prefill``
  receives): the image token spans of every row, the prompt's input embeddings as the language model
  read them (image features already merged; ViSpec's adaptor reads them), the top hidden states
  (``return_hidden``: the final-norm features the LM head reads, what EAGLE-style heads consume), the
  penultimate hidden states (``return_penultimate``: the output of the second-to-last decoder layer;
  SpecVLM's gate and feature distillation), and the top hidden states gathered at the image positions
  (FLASH's latent compressor). Decode steps return :class:`VLMStepOutput` (logits, ``hidden``,
  ``penultimate``).

Example::

    >>> from transformers import AutoProcessor, Qwen2VLForConditionalGeneration
    >>> from mmspec import speculative_generate
    >>> from mmspec.models.vlm_targets import VLMRunner
    >>> model = Qwen2VLForConditionalGeneration.from_pretrained("Qwen/Qwen2-VL-2B-Instruct")
    >>> inputs = AutoProcessor.from_pretrained("Qwen/Qwen2-VL-2B-Instruct")(text=[prompt], images=[image],
    ...                                                                    return_tensors="pt")
    >>> out = speculative_generate(VLMRunner(model), None, max_new_tokens=256, **inputs)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmspec.cache import SlotState
from mmspec.hidden_capture import thread_scoped
from mmspec.runner import CausalLMRunner, StepOutput, prompt_attention_mask

#: supported transformers classes -> family name used in this module
SUPPORTED_CLASSES = {
    "LlavaForConditionalGeneration": "llava",
    "LlavaNextForConditionalGeneration": "llava_next",
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
#: model inputs accepted only by prefill (they describe the prompt's images)
PREFILL_ONLY_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
                       "second_per_grid_ts", "mm_token_type_ids", "image_sizes")


@dataclass
class VLMStepOutput(StepOutput):
    """Logits ``[B, T, V]``; top hidden states ``[B, T, D]`` (``return_hidden``: final-norm features, what
    the LM head reads) and penultimate hidden states ``[B, T, D]`` (``return_penultimate``: output of the
    second-to-last decoder layer), None when not asked for."""

    penultimate: torch.Tensor | None = None


@dataclass
class VLMPrefillOutput(VLMStepOutput):
    """The prefill's outputs plus what drafters read about the prompt's images.

    Slots index the padded prompt ``[B, T]`` (left padding included). ``logits`` are ``[B, 1, V]`` (the
    last slot) unless the runner was built with ``prefill_logits="all"``; hidden states cover every slot.

    Attributes:
        inputs_embeds: ``[B, T, D]`` the language model's input embeddings (image features merged in
            at the image positions; padding slots hold the pad token's embedding).
        image_mask: bool ``[B, T]``, True at image placeholder tokens (and Qwen video tokens).
        image_spans: per row, the ``(start, end)`` slot ranges (end exclusive) of each image, in prompt
            order (one range per image, a Qwen video counts as one image).
        image_embeds: ``[B, N, D]`` ``inputs_embeds`` at the image positions of each row, in prompt order,
            zero-padded to the row with most image tokens (``image_token_mask`` marks the real ones).
        image_hidden: ``[B, N, D]`` top hidden states at the same positions (None without ``return_hidden``).
        image_token_mask: bool ``[B, N]``.
        position_ids: the positions the prefill used: ``[3, B, T]`` for M-RoPE models, ``[B, T]`` otherwise.
        rope_deltas: LongTensor ``[B]`` (M-RoPE models; None otherwise): text position + delta = position on
            every axis after the prompt.
    """

    inputs_embeds: torch.Tensor | None = None
    image_mask: torch.Tensor | None = None
    image_spans: list[list[tuple[int, int]]] = field(default_factory=list)
    image_embeds: torch.Tensor | None = None
    image_hidden: torch.Tensor | None = None
    image_token_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    rope_deltas: torch.Tensor | None = None


def vlm_family(model: Any) -> str:
    """``"llava"``, ``"qwen2_vl"`` or ``"qwen2_5_vl"`` for a supported transformers VLM; ValueError otherwise."""
    for cls in type(model).__mro__:
        if cls.__name__ in SUPPORTED_CLASSES and cls.__module__.startswith("transformers."):
            return SUPPORTED_CLASSES[cls.__name__]
    raise ValueError(f"model must be one of transformers' {', '.join(SUPPORTED_CLASSES)}, got "
                     f"{type(model).__name__} (text-only causal LMs run with mmspec.CausalLMRunner)")


def gather_positions(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``values [B, T, ...]`` at ``mask [B, T]`` into ``[B, N, ...]`` (prompt order, zero-padded to the
    row with most True entries) and return it with the bool ``[B, N]`` mask of real entries."""
    counts = mask.sum(-1)
    width = int(counts.max()) if counts.numel() else 0
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :width]  # True slots first, in order
    index = order.reshape(*order.shape, *([1] * (values.ndim - 2))).expand(-1, -1, *values.shape[2:])
    packed = values.gather(1, index)
    real = torch.arange(width, device=mask.device) < counts.unsqueeze(-1)
    packed = packed * real.reshape(*real.shape, *([1] * (values.ndim - 2))).to(packed.dtype)
    return packed, real


class VLMRunner(CausalLMRunner):
    """Target interface over ``LlavaForConditionalGeneration`` (LLaVA-1.5), ``LlavaNextForConditionalGeneration``
    (LLaVA-1.6 / NeXT), ``Qwen2VLForConditionalGeneration`` or ``Qwen2_5_VLForConditionalGeneration``.

    Args:
        model: the transformers VLM (any dtype/device; put it in eval mode).
        return_hidden: return the top hidden states (final-norm features) of every call, and the
            image-position features at prefill (EAGLE, FLASH, ViSpec, SpecVLM heads need them).
        return_penultimate: also return the second-to-last decoder layer's output of every call.
        prefill_logits: ``"last"`` (default; the prefill's logits are ``[B, 1, V]``, the last prompt slot,
            and no others are computed) or ``"all"`` (``[B, T, V]``; what distillation reads), as for
            :class:`~mmspec.runner.CausalLMRunner`. Hidden states are always returned for every slot.
        read_hidden: ``"hooks"`` (default; two forward hooks read the top and penultimate hidden states) or
            ``"output_hidden_states"`` (transformers keeps every layer's output), as for ``CausalLMRunner``.

    ``prefill(input_ids, attention_mask, **model_inputs)`` takes the processor's outputs (``pixel_values``;
    ``image_sizes`` for LLaVA-NeXT; ``image_grid_thw`` and optionally ``mm_token_type_ids`` for Qwen, built
    from the image/video token ids when absent) and returns a :class:`VLMPrefillOutput`; ``forward`` and
    ``commit`` work as in :class:`~mmspec.runner.CausalLMRunner` (text tokens only).
    """

    def __init__(self, model: Any, return_hidden: bool = False, return_penultimate: bool = False,
                 prefill_logits: str = "last", read_hidden: str = "hooks") -> None:
        self.family = vlm_family(model)
        super().__init__(model, return_hidden=return_hidden, prefill_logits=prefill_logits, read_hidden=read_hidden)
        self.return_penultimate = return_penultimate
        self.mrope = self.family in MROPE_FAMILIES
        text_config = model.config.get_text_config()
        if "sliding_attention" in (getattr(text_config, "layer_types", None) or ()):
            raise NotImplementedError("VLMRunner does not support sliding-window attention layers (their cache "
                                      "drops old slots, which breaks per-row rollback); set use_sliding_window=False")
        self.language_model = getattr(getattr(model, "model", None), "language_model", None)
        if self.language_model is None:
            raise ValueError(f"cannot find the language model of {type(model).__name__} (expected model.model."
                             "language_model, the transformers 5 layout)")
        self.rope_deltas: torch.Tensor | None = None  # [B] for M-RoPE models
        self.prompt: VLMPrefillOutput | None = None

    # -- token ids of the prompt's images ----------------------------------------------------------------
    @property
    def image_token_id(self) -> int:
        return int(self.model.config.image_token_id)

    @property
    def video_token_id(self) -> int | None:
        value = getattr(self.model.config, "video_token_id", None)
        return None if value is None or not self.mrope else int(value)

    def model_positions(self, text_positions: torch.Tensor) -> torch.Tensor:
        """Positions the model reads for text slots at ``text_positions [B, T]`` (the core's per-row
        counters): the same ``[B, T]`` for LLaVA(-NeXT); ``[3, B, T]`` = text position + rope delta on every axis
        for M-RoPE models (valid after :meth:`prefill`)."""
        if not self.mrope:
            return text_positions
        if self.rope_deltas is None:
            raise RuntimeError("call prefill() before decoding: M-RoPE positions need the prompt's rope deltas")
        shifted = text_positions + self.rope_deltas.to(text_positions.device).unsqueeze(-1)
        return shifted.unsqueeze(0).expand(3, -1, -1)

    # -- prefill ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                **model_inputs: Any) -> VLMPrefillOutput:
        """Run the prompt with its images and start a fresh cache (left or right padding allowed)."""
        if input_ids is None:
            raise ValueError("VLMRunner.prefill needs input_ids [B, T] (the prompt with its image placeholder tokens)")
        attention_mask = prompt_attention_mask(input_ids, attention_mask).long()
        model_inputs = {k: v for k, v in model_inputs.items() if v is not None}
        spans, image_mask = self._image_layout(input_ids, attention_mask, model_inputs)

        self.cache = self._new_cache(input_ids.shape[0])
        self.slots = SlotState.from_attention_mask(attention_mask)
        if self.mrope:
            positions = self._prompt_mrope_positions(input_ids, attention_mask, model_inputs)
        else:
            positions = self.slots.prompt_positions()

        captured: dict[str, torch.Tensor] = {}

        def grab_embeddings(module, args, kwargs):  # what the language model reads, images merged in
            captured["inputs_embeds"] = kwargs.get("inputs_embeds")

        # thread-scoped: the language model is shared, another thread's forward must not overwrite the capture
        handle = self.language_model.register_forward_pre_hook(thread_scoped(grab_embeddings), with_kwargs=True)
        try:
            out = self._run(input_ids, attention_mask, positions, prefill=True, **model_inputs)
        finally:
            handle.remove()
        embeds = captured.get("inputs_embeds")
        if embeds is None:
            raise RuntimeError(f"{type(self.model).__name__} did not call its language model with inputs_embeds; "
                               "this transformers version is not supported by VLMRunner")
        image_embeds, token_mask = gather_positions(embeds, image_mask)
        image_hidden = gather_positions(out.hidden, image_mask)[0] if out.hidden is not None else None
        self.prompt = VLMPrefillOutput(
            out.logits, out.hidden, out.penultimate, inputs_embeds=embeds, image_mask=image_mask,
            image_spans=spans, image_embeds=image_embeds, image_hidden=image_hidden, image_token_mask=token_mask,
            position_ids=positions, rope_deltas=self.rope_deltas)
        return self.prompt

    def _prompt_mrope_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                model_inputs: dict[str, Any]) -> torch.Tensor:
        """``[3, B, T]`` prompt positions from the model's own ``get_rope_index``; sets ``rope_deltas``."""
        if "mm_token_type_ids" not in model_inputs:  # transformers 5 processors return it; rebuild it otherwise
            types = torch.zeros_like(input_ids, dtype=torch.int32)
            types = types.masked_fill(input_ids == self.image_token_id, 1)
            if self.video_token_id is not None:
                types = types.masked_fill(input_ids == self.video_token_id, 2)
            model_inputs["mm_token_type_ids"] = types
        types = model_inputs["mm_token_type_ids"]
        if not isinstance(types, torch.Tensor) or tuple(types.shape) != tuple(input_ids.shape):
            raise ValueError(f"mm_token_type_ids must be a tensor shaped like input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(types.shape) if isinstance(types, torch.Tensor) else type(types).__name__}")
        rope_inputs = {k: model_inputs[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
                       if k in model_inputs}
        if "image_grid_thw" not in rope_inputs and "video_grid_thw" not in rope_inputs:
            # text-only prompt: M-RoPE degenerates to ordinary positions on all three axes
            self.rope_deltas = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
            return self.model_positions(self.slots.prompt_positions())
        positions, deltas = self.model.model.get_rope_index(input_ids, mm_token_type_ids=types,
                                                            attention_mask=attention_mask, **rope_inputs)
        self.rope_deltas = deltas.reshape(-1).to(device=input_ids.device, dtype=torch.long)
        return positions.to(input_ids.device)

    def _image_layout(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      model_inputs: dict[str, Any]) -> tuple[list[list[tuple[int, int]]], torch.Tensor]:
        """Check the images against the prompt's placeholders; returns per-row image spans and the mask."""
        valid = attention_mask.bool()
        image_tokens = (input_ids == self.image_token_id) & valid
        video_tokens = (input_ids == self.video_token_id) & valid if self.video_token_id is not None \
            else torch.zeros_like(image_tokens)
        if ((input_ids == self.image_token_id) & ~valid).any():
            raise ValueError(f"input_ids holds the image token id {self.image_token_id} at padding positions "
                             "(attention_mask 0): pad with another token")
        sizes = {"image": self._tokens_per_item("image", image_tokens, model_inputs),
                 "video": self._tokens_per_item("video", video_tokens, model_inputs)}
        spans: list[list[tuple[int, int]]] = [[] for _ in range(input_ids.shape[0])]
        for kind, mask in (("image", image_tokens), ("video", video_tokens)):
            rows, slots = mask.nonzero(as_tuple=True)  # row-major: the order the model assigns features
            cursor = 0
            for item, size in enumerate(sizes[kind]):
                row, start = int(rows[cursor]), int(slots[cursor])
                end = int(slots[cursor + size - 1]) + 1
                if int(rows[cursor + size - 1]) != row or end - start != size:
                    raise ValueError(f"the placeholder tokens of {kind} {item} are not one contiguous run in one "
                                     f"row: the images do not match the prompt's {kind} placeholders")
                spans[row].append((start, end))
                cursor += size
        for row_spans in spans:
            row_spans.sort()
        return spans, image_tokens | video_tokens

    def _tokens_per_item(self, kind: str, tokens: torch.Tensor, model_inputs: dict[str, Any]) -> list[int]:
        """Placeholder tokens of each image (or Qwen video) in prompt order, checked against the inputs."""
        num_tokens = int(tokens.sum())
        pixels_key = "pixel_values" if kind == "image" else "pixel_values_videos"
        pixels = model_inputs.get(pixels_key)
        token_id = self.image_token_id if kind == "image" else self.video_token_id
        encoded = (model_inputs.get("mm_encoder_outputs") or {}).get(kind)
        if pixels is None and encoded is not None:
            return self._encoded_tokens_per_item(kind, num_tokens, encoded)
        if pixels is None:
            if num_tokens:
                raise ValueError(f"the prompt holds {num_tokens} {kind} placeholder tokens (id {token_id}) but no "
                                 f"{pixels_key} was given")
            return []
        if not isinstance(pixels, torch.Tensor):
            raise ValueError(f"{pixels_key} must be a torch.Tensor, got {type(pixels).__name__}")
        if num_tokens == 0:
            raise ValueError(f"{pixels_key} was given but the prompt holds no {kind} placeholder token (id "
                             f"{token_id}): expand the prompt with the model's processor")
        if self.mrope:
            return self._qwen_tokens_per_item(kind, num_tokens, pixels, model_inputs)
        return self._llava_tokens_per_image(num_tokens, pixels, model_inputs, tokens)

    def _encoded_tokens_per_item(self, kind: str, num_tokens: int, encoded: Any) -> list[int]:
        """Tokens per item of features the model's own encoder already computed (transformers' ``generate()``
        encodes images before its decoding loop and passes ``mm_encoder_outputs`` instead of pixels)."""
        if self.mrope:
            raise NotImplementedError(f"{type(self.model).__name__} with pre-encoded {kind} features: M-RoPE positions "
                                      f"need {kind}_grid_thw, which generate() does not pass on; decode through "
                                      "VLMPipeline instead")
        features = getattr(encoded, "pooler_output", None)
        if isinstance(features, torch.Tensor) and features.ndim == 3:  # [items, tokens, width]
            features = list(features)
        if not isinstance(features, (list, tuple)) or not all(isinstance(f, torch.Tensor) for f in features):
            raise ValueError(f"mm_encoder_outputs[{kind!r}].pooler_output must be per-{kind} feature tensors, got "
                             f"{type(features).__name__}")
        tokens = [int(f.reshape(-1, f.shape[-1]).shape[0]) for f in features]
        if sum(tokens) != num_tokens:
            raise ValueError(f"the prompt holds {num_tokens} {kind} placeholder tokens but the encoded features "
                             f"hold {sum(tokens)} ({tokens} per {kind})")
        return tokens

    def _qwen_tokens_per_item(self, kind: str, num_tokens: int, pixels: torch.Tensor,
                              model_inputs: dict[str, Any]) -> list[int]:
        grid_key = f"{kind}_grid_thw"
        grid = model_inputs.get(grid_key)
        if grid is None:
            raise ValueError(f"Qwen2-VL {kind}s need {grid_key} [num_{kind}s, 3] next to their pixel values")
        if not isinstance(grid, torch.Tensor) or grid.ndim != 2 or grid.shape[1] != 3:
            raise ValueError(f"{grid_key} must be a tensor [num_{kind}s, 3] (t, h, w patches per {kind}), got "
                             f"{tuple(grid.shape) if isinstance(grid, torch.Tensor) else type(grid).__name__}")
        patches = grid.long().prod(-1)
        if pixels.ndim != 2 or pixels.shape[0] != int(patches.sum()):
            raise ValueError(f"{'pixel_values' if kind == 'image' else 'pixel_values_videos'} must hold one row per "
                             f"patch: {grid_key} gives {int(patches.sum())} patches, got shape {tuple(pixels.shape)}")
        merge = int(self.model.config.vision_config.spatial_merge_size) ** 2
        tokens = (patches // merge).tolist()
        if sum(tokens) != num_tokens:
            raise ValueError(f"the prompt holds {num_tokens} {kind} placeholder tokens but {grid_key} describes "
                             f"{len(tokens)} {kind}(s) with {sum(tokens)} tokens ({tokens}): wrong {kind} count or "
                             "prompt not expanded by the processor")
        return tokens

    def _llava_tokens_per_image(self, num_tokens: int, pixels: torch.Tensor, model_inputs: dict[str, Any],
                                image_tokens: torch.Tensor) -> list[int]:
        if self.family == "llava_next":
            return self._llava_next_tokens_per_image(pixels, model_inputs, image_tokens)
        if "image_sizes" in model_inputs:
            raise NotImplementedError("LLaVA checkpoints with per-image sizes (image_sizes, e.g. Pixtral towers) are "
                                      "not supported by VLMRunner")
        if pixels.ndim != 4:
            raise ValueError(f"pixel_values must be [num_images, channels, height, width], got {tuple(pixels.shape)}")
        count = pixels.shape[0]
        per_image = self._llava_features_per_image(pixels)
        if per_image is None:  # unknown vision tower: images of one size give equal shares
            per_image = num_tokens // count
        if per_image * count != num_tokens:
            raise ValueError(f"the prompt holds {num_tokens} image placeholder tokens but pixel_values holds {count} "
                             f"image(s) of {per_image} tokens each: wrong image count or prompt not expanded by "
                             "the processor")
        return [per_image] * count

    def _llava_next_tokens_per_image(self, pixels: torch.Tensor, model_inputs: dict[str, Any],
                                     image_tokens: torch.Tensor) -> list[int]:
        """LLaVA-NeXT (anyres): an image's token count depends on its size; each image must be one run of
        placeholder tokens (the processor's layout: text always separates two images)."""
        if pixels.ndim != 5:
            raise ValueError(f"LLaVA-NeXT pixel_values must be [num_images, num_patches, channels, height, width], got "
                             f"{tuple(pixels.shape)}")
        sizes = model_inputs.get("image_sizes")
        if sizes is None or tuple(sizes.shape) != (pixels.shape[0], 2):
            raise ValueError(f"LLaVA-NeXT needs image_sizes [num_images, 2] (the processor returns it) for the "
                             f"{pixels.shape[0]} image(s) of pixel_values, got "
                             f"{None if sizes is None else tuple(sizes.shape)}")
        flat = image_tokens.flatten().long()  # row-major, like the model's feature assignment
        edges = torch.diff(torch.cat([flat.new_zeros(1), flat, flat.new_zeros(1)]))
        starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
        width = image_tokens.shape[1]
        runs = []
        for start, end in zip(starts.tolist(), ends.tolist()):  # a run never continues into the next row
            while start // width != (end - 1) // width:
                cut = (start // width + 1) * width
                runs.append(cut - start)
                start = cut
            runs.append(end - start)
        if len(runs) != pixels.shape[0]:
            raise ValueError(f"the prompt holds {len(runs)} run(s) of image placeholder tokens but pixel_values holds "
                             f"{pixels.shape[0]} image(s): wrong image count or prompt not expanded by the processor")
        return runs

    def _llava_features_per_image(self, pixels: torch.Tensor) -> int | None:
        """Image features a LLaVA vision tower gives per image (CLIP / SigLIP towers), else None."""
        vision = self.model.config.vision_config
        if getattr(vision, "model_type", None) not in ("clip_vision_model", "siglip_vision_model"):
            return None
        patch = int(vision.patch_size)
        tokens = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
        tokens += int(vision.model_type == "clip_vision_model")  # CLIP's class token
        if self.model.config.vision_feature_select_strategy == "default":
            tokens -= 1  # "default" drops the first feature
        return tokens

    # -- one forward ----------------------------------------------------------------------------------------
    def _run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             prefill: bool = False, **model_inputs: Any) -> VLMStepOutput:
        if self.mrope and position_ids.ndim == 2:
            position_ids = self.model_positions(position_ids)
        logits, hidden, penultimate = self._call_model(input_ids, attention_mask, position_ids, prefill=prefill,
                                                       penultimate=self.return_penultimate, **model_inputs)
        return VLMStepOutput(logits, hidden, penultimate)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                attention: torch.Tensor | None = None, **model_inputs: Any) -> VLMStepOutput:
        """Append text ``tokens [B, T]`` (see :meth:`CausalLMRunner.forward`); M-RoPE positions are the core's
        text positions plus the rope deltas, tree offsets included, on all three axes."""
        given = [k for k in PREFILL_ONLY_INPUTS if model_inputs.get(k) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} can only be given to prefill(): images belong to the prompt, "
                             "decode steps are text only")
        return super().forward(tokens, valid, offsets, attention, **model_inputs)
