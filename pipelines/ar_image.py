"""Discrete autoregressive image generation with speculative decoding (issue 4).

:class:`ARImagePipeline` composes a LlamaGen-style target (:class:`~mmspec.models.llamagen.LlamaGenTransformer`),
an image tokenizer (``vqvae``: the project's :class:`~mmspec.models.tokenizers.VQTokenizer` or anything with
``decode``, ``codebook_neighbors`` and ``vocab_size``) and an optional EAGLE draft head. A call names its
method (``method="lantern"``: the settings stored with the checkpoint, ``speculation_config.json``) or passes
its config (``method=LanternConfig(k=64)``); the config builds the drafter and the acceptance rule
(:mod:`mmspec.methods`), and the pipeline runs them in the core's
:func:`~mmspec.speculate.speculative_generate`:

=========  ====================  ===================================  ==========================================  ==========
method     config                drafter                              rule (default; ``rule=`` overrides)         lossless
=========  ====================  ===================================  ==========================================  ==========
"none"     -                     None (target-only baseline)          Exact / Greedy                              yes
"eagle"    ``EagleConfig``       EagleDrafter (chain, tree, blocks)   Exact / Greedy                              yes
"lantern"  ``LanternConfig``     EagleDrafter                         LanternRule(codebook neighbours, k, delta)  no (delta>0)
"sjd"      ``SJDConfig``         JacobiDrafter (no draft model)       Exact / Greedy                              yes
"scd"      ``SCDConfig``         JacobiDrafter, coupled redraws       Exact / Greedy                              yes
"gsd"      ``GSDConfig``         JacobiDrafter                        GroupedRule(G, prob_threshold, embeddings)  no (G>1)
"mulo"     ``MuLoConfig``        MuLoDrafter (low-res rows)           PoolingThresholdRule(neighbours, k, tau)    no
=========  ====================  ===================================  ==========================================  ==========

"mulo" runs its own loop, the core's block-wise :func:`~mmspec.local_speculate.local_speculative_generate`
(local rejection and resampling of radius-l neighbourhoods), instead of the raster one. A method registered
from outside the package (:func:`mmspec.methods.register`) runs the same way.

Classifier-free guidance runs the target on a doubled batch ``[cond; uncond]`` through
:class:`~mmspec.runner.GuidedRunner`; drafters see the guided distributions only through verification
(the EAGLE head drafts from the conditional half's features), which keeps every lossless method lossless.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from mmspec.cpu_gemm import PackedCPUGemmMixin
from mmspec.inference_mode import inference_call, outside_inference_mode
from mmspec.methods import SETTINGS_FILE, BuildRequest, MethodConfig
from mmspec.models.llamagen_text import caption_features, check_text_encoder
from mmspec.models.mulo import check_mulo_pair
from mmspec.models.text import WordTokenizer
from mmspec.pipelines.callbacks import PartialTokens, PipelineInterrupted, StepCallback
from mmspec.pipelines.conditioning import (
    LEGACY_TEXT_VOCAB_FILE,
    WordVocabularyMixin,
    as_prompt_list,
    check_class_labels,
    check_condition,
    condition_rows,
    images_for_output_type,
)
from mmspec.pipelines.generators import check_generator, merge_image_outputs, row_callbacks, split_generators
from mmspec.pipelines.method_settings import MethodSettingsMixin, MovedKeywords, reject_removed_keywords
from mmspec.pipelines.pretrained import PretrainedPipelineMixin
from mmspec.rules import AcceptanceRule
from mmspec.runner import CausalLMRunner, GuidedRunner
from mmspec.sampling import SamplingConfig
from mmspec.shared_locks import shared_lock
from mmspec.speculate import SpeculativeOutput, speculative_generate
from mmspec.stats import SpecStats
from mmspec.validation import MAX_OUTPUTS_PER_PROMPT, check_count, check_guidance_scale

OUTPUT_TYPES = ("pil", "np", "pt", "tokens")

_EAGLE, _JACOBI = ("eagle", "lantern"), ("sjd", "gsd")

#: The method keywords ``__call__`` took before methods became configs: keyword -> (config field, methods whose
#: config has it). Passing one raises a ``TypeError`` naming the field (:func:`reject_removed_keywords`).
MOVED_KEYWORDS: MovedKeywords = {
    "num_draft_tokens": ("num_draft_tokens", _EAGLE), "tree": ("tree", _EAGLE),
    "draft_confidence_threshold": ("draft_confidence_threshold", _EAGLE),
    "argmax_drafts": ("argmax_drafts", _EAGLE), "eagle_blocks": ("blocks", _EAGLE),
    "eagle_guided": ("guided", _EAGLE), "lookup_tail": ("lookup_tail", _EAGLE),
    "lookup_only_from": ("lookup_only_from", _EAGLE),
    "lantern_k": ("k", ("lantern",)), "lantern_delta": ("delta", ("lantern",)), "lantern_lam": ("lam", ("lantern",)),
    "sjd_window": ("window", _JACOBI), "sjd_init": ("init", _JACOBI),
    "gsd_group_size": ("group_size", ("gsd",)), "gsd_prob_threshold": ("prob_threshold", ("gsd",)),
    "gsd_distance_threshold": ("distance_threshold", ("gsd",)),
    "mulo_k": ("k", ("mulo",)), "mulo_tau": ("tau", ("mulo",)), "mulo_radius": ("radius", ("mulo",)),
    "mulo_resample": ("resample", ("mulo",)), "mulo_guidance_scale": ("guidance_scale", ("mulo",)),
}


@dataclass
class ARImagePipelineOutput(BaseOutput):
    """Output of :class:`ARImagePipeline`.

    Attributes:
        images: list of PIL images (``output_type="pil"``), float32 array ``[B, H, W, 3]`` in [0, 1]
            ("np"), float tensor ``[B, 3, H, W]`` in [0, 1] ("pt"), or None ("tokens").
        tokens: LongTensor ``[B, h, w]`` image tokens (raster order).
        stats: :class:`~mmspec.stats.SpecStats` of the run (mean accepted length includes the bonus token).
        drafted: bool ``[B, h, w]``: True where the token is a drafted-and-accepted token, False where the
            target produced it (first token, corrections, bonus tokens; everything for ``method="none"``).
    """

    images: list[PIL.Image.Image] | np.ndarray | torch.Tensor | None
    tokens: torch.Tensor
    stats: SpecStats
    drafted: torch.Tensor

    def drafted_overlay(self, color: tuple[int, int, int] = (255, 0, 255), alpha: float = 0.5) -> list[PIL.Image.Image]:
        """The images with every drafted-and-accepted token's patch tinted by ``color`` (PIL list)."""
        if self.images is None:
            raise ValueError("drafted_overlay needs decoded images: call the pipeline with output_type 'pil', "
                             "'np' or 'pt'")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        images = _as_numpy(self.images)  # [B, H, W, 3] in [0, 1]
        batch, height, width, _ = images.shape
        grid_h, grid_w = self.drafted.shape[1:]
        mask = self.drafted.cpu().numpy().repeat(height // grid_h, 1).repeat(width // grid_w, 2)[..., None]
        tint = np.asarray(color, dtype=np.float32) / 255.0
        mixed = np.where(mask, (1 - alpha) * images + alpha * tint, images)
        return DiffusionPipeline.numpy_to_pil(mixed)


def _as_numpy(images: Any) -> np.ndarray:
    if isinstance(images, torch.Tensor):
        return images.detach().float().permute(0, 2, 3, 1).cpu().numpy()
    if isinstance(images, np.ndarray):
        return images
    return np.stack([np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0 for image in images])


class ARImagePipeline(MethodSettingsMixin, WordVocabularyMixin, PretrainedPipelineMixin, PackedCPUGemmMixin,
                      DiffusionPipeline):
    r"""Text- or class-conditioned discrete AR image generation, speculative or not, on one core loop.

    Args:
        transformer: :class:`~mmspec.models.llamagen.LlamaGenTransformer` (c2i or t2i with a word table).
        vqvae: image tokenizer with ``decode(tokens [B, h, w]) -> images [B, 3, H, W]`` in [0, 1],
            ``codebook_neighbors(k)`` and ``vocab_size`` (:class:`~mmspec.models.tokenizers.VQTokenizer`).
        eagle_head: :class:`~mmspec.models.eagle.EagleHead` for "eagle" / "lantern" (None: those methods
            are unavailable). It is bound to the transformer's embeddings and LM head here.
        eagle_block_head: optional second :class:`~mmspec.models.eagle.EagleHead` with ``num_future`` K > 1
            (FLASH's readout: K drafts per forward), used for argmax chains (``EagleConfig.blocks``); the
            ``eagle_head`` keeps drafting token by token where that is faster (sampling, trees).
        mulo_drafter / mulo_upsampler: MuLo-SD's low-resolution AR model (the target's condition
            interface, ``block_size`` = the target's / r^2) and its
            :class:`~mmspec.models.mulo.TokenUpsampler` (None: "mulo" is unavailable).
        text_tokenizer: word vocabulary of a t2i model with ``text_vocab_size`` (a
            :class:`~mmspec.models.text.WordTokenizer`, saved as the ``text_tokenizer/`` component).
        text_encoder / tokenizer: a t2i model that reads caption features (LlamaGen's official t2i
            checkpoints: ``text_vocab_size=None``) gets them from this transformers encoder (T5) and its
            tokenizer, in LlamaGen's layout (:mod:`mmspec.models.llamagen_text`).

    ``vqvae.decode`` gives images in ``vqvae.decode_range`` (default ``(0, 1)``; LlamaGen's VQ: ``(-1, 1)``),
    mapped to [0, 1] for the outputs.

    Threads: several threads may call one pipeline at once; each call decodes with its own runners, caches
    and drafter, and the shared pieces (the caption tokenizer, the codebook-neighbour table) are guarded by
    :func:`~mmspec.shared_locks.shared_lock`. Results equal those of the same calls made one after another.

    Methods: ``pipe.methods()`` lists the names ``__call__`` takes; ``pipe.method_config("eagle",
    do_sample=False)`` is the config a call with ``method="eagle"`` uses (the checkpoint's stored settings,
    :attr:`speculation_settings`, read from ``speculation_config.json`` by ``from_pretrained`` and written by
    ``save_pretrained``), a starting point for ``.replace(...)``.

    Loading: ``from_pretrained`` takes a folder, a zoo id or a hub id and diffusers' loading keywords
    (:class:`~mmspec.pipelines.pretrained.PretrainedPipelineMixin`); ``diffusers.DiffusionPipeline.from_pretrained``
    loads a saved folder too. ``enable_model_cpu_offload()`` (diffusers, needs an accelerator) offloads the
    text encoder, transformer and tokenizer in turn; the draft models stay on the accelerator.

    Example::

        >>> pipe = ARImagePipeline.from_pretrained("mmspec/shapes-t2i")
        >>> out = pipe("a red circle", method="eagle", generator=torch.Generator().manual_seed(0))
        >>> out.images[0], out.stats.mean_accepted_length, out.drafted_overlay()[0]
        >>> wider = pipe.method_config("lantern").replace(k=64, lam=3.0)  # the stored settings, two changed
        >>> out = pipe("a red circle", method=wider, generator=torch.Generator().manual_seed(0))
    """

    pipeline_family = "ar_image"
    _callback_tensor_inputs = ["new_tokens", "drafted", "num_generated"]
    _callback_tensor_fill = {"new_tokens": -1, "drafted": False, "num_generated": 0}  # other rows, per-image calls

    _optional_components = ["eagle_head", "mulo_drafter", "mulo_upsampler", "text_encoder", "tokenizer",
                            "eagle_block_head", "text_tokenizer"]
    # the target runs every step, the drafters between its steps: they stay on the accelerator under offload
    model_cpu_offload_seq = "text_encoder->transformer->vqvae"
    _exclude_from_cpu_offload = ["eagle_head", "eagle_block_head", "mulo_drafter", "mulo_upsampler"]
    extra_pipeline_files = (SETTINGS_FILE, LEGACY_TEXT_VOCAB_FILE)

    def __init__(self, transformer: Any, vqvae: Any, eagle_head: Any = None, text_tokenizer: WordTokenizer | None = None,
                 mulo_drafter: Any = None, mulo_upsampler: Any = None, text_encoder: Any = None,
                 tokenizer: Any = None, eagle_block_head: Any = None) -> None:
        super().__init__()
        if int(vqvae.vocab_size) != int(transformer.config.vocab_size):
            raise ValueError(f"vqvae has {vqvae.vocab_size} codebook entries but the transformer predicts "
                             f"{transformer.config.vocab_size} image tokens")
        check_mulo_pair(transformer, mulo_drafter, mulo_upsampler)
        check_text_encoder(transformer, text_encoder, tokenizer)
        if eagle_block_head is not None and int(getattr(eagle_block_head.config, "num_future", 1)) < 2:
            raise ValueError("eagle_block_head must draft several tokens per forward (an EagleHead with num_future > 1); "
                             "a plain head is the eagle_head")
        self.register_modules(transformer=transformer, vqvae=vqvae, eagle_head=eagle_head, mulo_drafter=mulo_drafter,
                              mulo_upsampler=mulo_upsampler, text_encoder=text_encoder, tokenizer=tokenizer,
                              eagle_block_head=eagle_block_head)
        for head in (eagle_head, eagle_block_head):
            if head is not None:
                head.bind_target(transformer.get_input_embeddings(), transformer.get_output_embeddings())
        self._set_text_tokenizer(text_tokenizer, getattr(transformer.config, "text_vocab_size", None))
        self._neighbors: torch.Tensor | None = None  # cached codebook_neighbors table [V, k_max]

    # -- helpers --------------------------------------------------------------------------------------
    @property
    def grid_size(self) -> int:
        return int(round(self.transformer.config.block_size ** 0.5))

    def codebook_neighbors(self, k: int) -> torch.Tensor:
        """``vqvae.codebook_neighbors(k)`` computed once (for the largest k asked so far) and cached; built
        under the pipeline's lock, so concurrent calls build it once and never read a smaller table."""
        with shared_lock(self):
            if self._neighbors is None or self._neighbors.shape[1] < k:
                with outside_inference_mode():  # the table outlives the call that first asks for it
                    self._neighbors = self.vqvae.codebook_neighbors(k).to(torch.long)
            return self._neighbors[:, :k]

    def codebook_embeddings(self) -> torch.Tensor | None:
        """The codebook vectors ``[V, D]`` if the tokenizer exposes them (GSD's embedding distances)."""
        if hasattr(self.vqvae, "codebook_embeddings"):
            return self.vqvae.codebook_embeddings().detach()
        codebook = getattr(self.vqvae, "codebook", None)
        return codebook.detach() if isinstance(codebook, torch.Tensor) else None

    def encode_prompt(self, prompt: list[str], device: torch.device | None = None
                      ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The transformer's condition input for ``prompt`` and its attention mask ``[B, C]``, in LlamaGen's
        layout (left-padded; longer prompts keep their first C tokens): ``{"condition_ids": word ids [B, C]}``
        (-1 pads) from the word vocabulary, or ``{"condition_embeds": [B, C, caption_dim]}`` (zero pads)
        from the text encoder, on ``device`` (default: the transformer's)."""
        length = self.transformer.config.cls_token_num
        if device is None:  # read once: diffusers' ``device`` walks offloading hooks (~0.15 ms a call)
            device = self.transformer.device
        if self.text_encoder is not None:  # the encoder may live elsewhere (e.g. a large T5 on the CPU)
            with shared_lock(self.tokenizer):  # the fast tokenizer's padding settings are shared by all calls
                features, mask = caption_features(prompt, self.tokenizer, self.text_encoder, length)
            features, mask = self.transformer.pad_condition(features.to(device), mask.to(device))
            return {"condition_embeds": features}, mask.to(device)
        ids = self.text_tokenizer.batch(prompt, length)
        return {"condition_ids": ids.to(device)}, (ids >= 0).long().to(device)

    def check_inputs(self, prompt: Any, class_labels: Any, method: Any, do_sample: bool, top_k: int | None,
                     guidance_scale: float, num_images_per_prompt: int, output_type: str,
                     rule: AcceptanceRule | None, generator: Any) -> None:
        config = self.transformer.config
        self.check_method(method)
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {list(OUTPUT_TYPES)}, got {output_type!r}")
        check_condition(prompt, class_labels, config.model_type == "t2i",
                        ("text-conditioned (t2i)", "class-conditioned (c2i)"))
        if prompt is not None:
            prompts = as_prompt_list(prompt)
            if getattr(config, "text_vocab_size", None) is not None:
                self._check_word_prompts(prompts)
            elif self.text_encoder is None:
                raise ValueError("this t2i transformer reads caption features (text_vocab_size=None): build the "
                                 "pipeline with its text_encoder and tokenizer (LlamaGen: flan-t5-xl; see "
                                 "load_llamagen_components)")
            else:
                empty = [i for i, text in enumerate(prompts) if not text.strip()]
                if empty:
                    raise ValueError(f"prompt {empty[0]} is empty")
        else:
            check_class_labels(class_labels, config.num_classes)
        check_count(num_images_per_prompt, "num_images_per_prompt", MAX_OUTPUTS_PER_PROMPT)
        vocab = config.vocab_size
        if top_k is not None and top_k > vocab:
            raise ValueError(f"top_k={top_k} is larger than the image vocabulary ({vocab} tokens)")
        check_guidance_scale(guidance_scale, "guidance_scale")  # finite, <= MAX_GUIDANCE_SCALE: no overflow
        if guidance_scale != 1.0 and not config.class_dropout_prob > 0:
            raise ValueError(f"guidance_scale={guidance_scale} needs an unconditional model (a transformer trained "
                             "with class_dropout_prob > 0); this one has none: use guidance_scale=1.0")
        if rule is not None:
            if not isinstance(rule, AcceptanceRule):
                raise ValueError(f"rule must be an AcceptanceRule, got {type(rule).__name__}")
            if rule.greedy == do_sample:
                raise ValueError(f"rule.greedy={rule.greedy} contradicts do_sample={do_sample}: build the rule with "
                                 f"greedy={not do_sample}")
        check_generator(generator, "image")

    # -- generation -----------------------------------------------------------------------------------
    @inference_call
    def __call__(self, prompt: str | list[str] | None = None, class_labels: int | list[int] | torch.Tensor | None = None,
                 method: str | MethodConfig = "none", *, do_sample: bool = True, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float = 1.0, guidance_scale: float = 3.0,
                 num_images_per_prompt: int = 1, generator: torch.Generator | None = None, output_type: str = "pil",
                 rule: AcceptanceRule | None = None,
                 callback_on_step_end: Callable[[ARImagePipeline, int, int, dict[str, torch.Tensor]], dict] | None = None,
                 callback_on_step_end_tensor_inputs: list[str] | None = None, return_dict: bool = True,
                 **removed: Any) -> ARImagePipelineOutput | tuple:
        """Generate images token by token, speculatively unless ``method="none"``.

        Args:
            prompt: text prompt(s) (t2i models); class_labels: class id(s) (c2i models). Exactly one.
            method: "none" (target only), a method name (``self.methods()``: "eagle", "lantern", "sjd", "gsd",
                "mulo" and any registered from outside) run with the checkpoint's stored settings for this
                decoding mode and batch (``self.method_config(name, ...)``), or a config
                (``EagleConfig(num_draft_tokens=8)``, ``self.method_config("lantern").replace(k=64)``) run
                as given. A method's settings are its config's fields (:mod:`mmspec.methods`); passing one
                as a keyword here raises a ``TypeError`` that names the field.
            do_sample / temperature / top_k / top_p: how the (guided) logits become distributions; greedy
                decoding when ``do_sample=False``.
            guidance_scale: classifier-free guidance (1.0: no guidance, no doubled batch).
            num_images_per_prompt: images per prompt, at most :data:`~mmspec.validation.MAX_OUTPUTS_PER_PROMPT`
                (4096; rows ``prompt0 x n, prompt1 x n, ...``).
            generator: one ``torch.Generator`` for every random draw (drafts, acceptance, resampling), or a
                list, one per image: each image is then decoded alone with its own generator, so it equals a
                call for that image alone (:mod:`.generators`; slower than one batched loop; the callback sees
                each image's own rounds, the other rows padded).
            output_type: "pil", "np", "pt" or "tokens" (no decoding).
            rule: an :class:`~mmspec.rules.AcceptanceRule` replacing the method's (e.g. ``GroupedRule`` on
                EAGLE drafts); its ``greedy`` flag must equal ``not do_sample``.
            callback_on_step_end: called after every verification round (MuLo-SD: every block) in diffusers'
                convention, ``fn(pipeline, round_index, timestep, callback_kwargs) -> dict``, where
                ``timestep`` is the tokens the furthest image has so far and ``callback_kwargs`` holds the
                tensors named in ``callback_on_step_end_tensor_inputs``: ``"new_tokens"`` ``[B, M]`` (-1 pad),
                ``"drafted"`` ``[B, M]``, ``"num_generated"`` ``[B]`` (default: all three). diffusers'
                ``PipelineCallback`` objects work too. The tensors are read-only (:mod:`.callbacks`). Setting
                ``pipeline._interrupt = True`` in it stops the call after that round, as in diffusers: the
                images so far are returned, the positions not generated yet holding token 0 (``drafted``
                False there); with a list of generators the images not started yet get their first token only.
            return_dict: False returns the tuple ``(images, tokens, stats, drafted)`` instead.
        Returns:
            :class:`ARImagePipelineOutput` (or the tuple).
        """
        reject_removed_keywords(self, removed, MOVED_KEYWORDS, method)
        # 1. Check the inputs.
        self.check_inputs(prompt, class_labels, method, do_sample, top_k, guidance_scale, num_images_per_prompt,
                          output_type, rule, generator)
        step_callback = StepCallback(self, callback_on_step_end, callback_on_step_end_tensor_inputs)
        rows = condition_rows(prompt, class_labels, num_images_per_prompt)
        generators = split_generators(generator, len(rows), "images")
        if generators is not None:  # each image alone with its own random stream
            callbacks = row_callbacks(step_callback, len(rows), self._callback_tensor_fill)
            parts = [self(**row, method=method, do_sample=do_sample, temperature=temperature, top_k=top_k,
                          top_p=top_p, guidance_scale=guidance_scale, generator=g, output_type=output_type,
                          rule=rule, callback_on_step_end=callback)
                     for row, g, callback in zip(rows, generators, callbacks)]
            output = merge_image_outputs(ARImagePipelineOutput, parts)
            return output if return_dict else (output.images, output.tokens, output.stats, output.drafted)
        sampling = SamplingConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        # 2. Encode the condition: one row per image, doubled [cond; uncond] under guidance.
        inputs, mask, batch = self.encode_condition(prompt, class_labels, num_images_per_prompt, guidance_scale)
        # 3. Resolve the method: the stored or given config builds the drafter, the rule and (MuLo-SD) the loop.
        _, plan = self.build_method(method, BuildRequest(sampling, generator, guidance_scale, batch))
        target = self.target_runner(plan.drafter, guidance_scale)
        # 4. Run the loop: block_size tokens per row; every accept/reject happens in the core.
        loop = plan.loop or speculative_generate
        partial, stats = PartialTokens(batch, self.transformer.config.block_size, 0), SpecStats()
        with self._round_callback(batch, step_callback, partial) as on_round:
            try:
                out = loop(target, plan.drafter, None, mask, max_new_tokens=self.transformer.config.block_size,
                           sampling=sampling, rule=rule if rule is not None else plan.rule, generator=generator,
                           stats=stats, callback=on_round, **inputs)
            except PipelineInterrupted:  # pipe._interrupt set by a callback: the tokens so far
                out = partial.output(stats, mask.device)
        # 5. Decode the token grids.
        output = self.decode_tokens(out, output_type)
        self.maybe_free_model_hooks()  # model CPU offload: every model back to the CPU
        return output if return_dict else (output.images, output.tokens, output.stats, output.drafted)

    def encode_condition(self, prompt: Any, class_labels: Any, num_images_per_prompt: int, guidance_scale: float
                         ) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        """The target's condition inputs and attention mask for every image of a call, and the number of
        images: word ids or caption features ``[B, C(, D)]`` (t2i) or class ids ``[B]`` (c2i), each prompt's
        row repeated ``num_images_per_prompt`` times; under guidance the rows are doubled ``[cond; uncond]``
        with a ``condition_drop`` flag per row."""
        device = self.transformer.device
        if prompt is not None:
            condition, mask = self.encode_prompt([prompt] if isinstance(prompt, str) else list(prompt), device)
        else:
            condition = {"condition_ids": torch.as_tensor(class_labels, dtype=torch.long, device=device).reshape(-1)}
            mask = torch.ones(condition["condition_ids"].shape[0], 1, dtype=torch.long, device=device)
        (name, values), = condition.items()
        values = values.repeat_interleave(num_images_per_prompt, 0)
        mask = mask.repeat_interleave(num_images_per_prompt, 0)
        batch = values.shape[0]
        if guidance_scale == 1.0:
            return {name: values}, mask, batch
        inputs = {name: torch.cat([values, values]), "condition_drop": GuidedRunner.condition_drop(batch, device)}
        return inputs, torch.cat([mask, mask]), batch  # unconditional rows keep their prompt's layout, as LlamaGen's

    def target_runner(self, drafter: Any, guidance_scale: float) -> Any:
        """The transformer as the loop's target: with its hidden states when the drafter reads them, guided
        on the doubled batch under guidance."""
        reads_features = drafter is not None and drafter.needs_target_hidden
        target: Any = CausalLMRunner(self.transformer, return_hidden=reads_features)
        if guidance_scale != 1.0:
            target = GuidedRunner(target, guidance_scale, hidden=drafter.target_hidden if reads_features else "cond")
        return target

    @contextmanager
    def _round_callback(self, batch: int, step_callback: StepCallback, partial: PartialTokens
                        ) -> Iterator[Callable]:
        """The loop's per-round callback: records the round's tokens (``partial``), advances the progress bar,
        calls ``callback_on_step_end`` and then stops the loop if the pipeline was interrupted."""
        tokens_per_image = self.transformer.config.block_size
        progress = self.progress_bar(total=batch * tokens_per_image)
        generated = [0] * batch  # per image, on the host (this runs every round)
        rounds = [0]

        def on_round(new_tokens: torch.Tensor, drafted: torch.Tensor) -> None:
            partial.add(new_tokens, drafted)
            before = sum(generated)
            for row, gained in enumerate((new_tokens >= 0).sum(1).tolist()):
                generated[row] = min(generated[row] + gained, tokens_per_image)
            progress.update(sum(generated) - before)
            if step_callback.active:
                step_callback(rounds[0], max(generated), {"new_tokens": new_tokens, "drafted": drafted,
                                                          "num_generated": torch.tensor(generated)})
            rounds[0] += 1
            step_callback.stop_if_interrupted()

        try:
            yield on_round
        finally:
            progress.close()

    def decode_tokens(self, out: SpeculativeOutput, output_type: str) -> ARImagePipelineOutput:
        """The loop's output as token grids, the drafted map and (unless ``output_type="tokens"``) images."""
        batch, grid = out.sequences.shape[0], self.grid_size
        tokens = out.sequences.reshape(batch, grid, grid)
        drafted = out.drafted.reshape(batch, grid, grid)
        images: Any = None
        if output_type != "tokens":
            low, high = getattr(self.vqvae, "decode_range", (0.0, 1.0))
            pixels = ((self.vqvae.decode(tokens).float() - low) / (high - low)).clamp(0.0, 1.0)  # [B, 3, H, W]
            images = images_for_output_type(pixels, output_type)
        return ARImagePipelineOutput(images=images, tokens=tokens, stats=out.stats, drafted=drafted)
