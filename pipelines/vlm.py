"""VLM decoding with speculative decoding (issue 5): image or video frames + text in, text out.

:class:`VLMPipeline` composes a transformers vision-language model (the target: LLaVA, LLaVA-NeXT,
Qwen2-VL, Qwen2.5-VL, or the zoo's shapes captioner, itself a ``LlavaForConditionalGeneration``), its
processor, and optional draft heads. A call names its method (``method="flash"``: the settings stored with
the checkpoint, ``speculation_config.json``) or passes its config (``method=FlashConfig(num_draft_tokens=8)``);
the config builds the drafter (:mod:`mmspec.methods.vlm_heads`), and every method is one call of the core's
:func:`~mmspec.speculate.speculative_generate` with :class:`~mmspec.models.vlm_targets.VLMRunner` as the
target; the pipeline only formats the prompt, resolves the method and decodes the text:

===========  ==================  ==========================================================================
method       config              drafter
===========  ==================  ==========================================================================
"none"       -                   None (target-only baseline, same loop)
"eagle"      ``VLMEagleConfig``  EAGLE-style head over the target's features (chain or EAGLE-2 tree)
"flash"      ``FlashConfig``     FLASH: latent-compressed image span + semi-autoregressive head (chains)
"vispec"     ``ViSpecConfig``    ViSpec: vision adaptor (few image tokens + global vector) on the head
"specvlm"    ``SpecVLMConfig``   SpecVLM: elastic visual compressor picked per input by a gate
"draft_vlm"  ``DraftVLMConfig``  a standalone small VLM of the same family (classic speculative decoding)
===========  ==================  ==========================================================================

Every method is lossless: greedy output equals ``"none"`` token for token, sampled output follows the
target's distribution (the acceptance rule is exact speculative sampling). Heads and settings only change
speed. A method registered from outside the package (:func:`mmspec.methods.register`) runs the same way.

Streaming: ``callback_on_step_end`` sees every verification round; :meth:`VLMPipeline.stream` yields
:class:`VLMStreamChunk` text deltas per row (with which tokens were drafted and accepted), and
``streamer=`` takes a transformers streamer (``TextStreamer``, ``TextIteratorStreamer``) for batch 1.

Threads: one pipeline may serve several threads at once (``__call__`` and :meth:`VLMPipeline.stream`
alike). Each call decodes with its own runner, KV cache and drafter, and the hooks a call puts on the
shared models read only its own thread's forwards; only the processor call is serialised (the fast
tokenizer's padding settings are shared state, :mod:`mmspec.shared_locks`). Results equal those of the
same calls made one after another.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from mmspec.cpu_gemm import PackedCPUGemmMixin
from mmspec.inference_mode import inference_call
from mmspec.methods import SETTINGS_FILE, BuildRequest, MethodConfig
from mmspec.methods.vlm_heads import bind_head, draft_component
from mmspec.models.vlm_prompts import format_vlm_prompt
from mmspec.models.vlm_targets import VLMRunner, vlm_family
from mmspec.pipelines.callbacks import PartialTokens, PipelineInterrupted, StepCallback
from mmspec.pipelines.generators import check_generator, row_callbacks, split_generators
from mmspec.pipelines.method_settings import MethodSettingsMixin, MovedKeywords, reject_removed_keywords
from mmspec.pipelines.pretrained import PretrainedPipelineMixin
from mmspec.sampling import SamplingConfig
from mmspec.shared_locks import shared_lock
from mmspec.speculate import speculative_generate
from mmspec.stats import SpecStats
from mmspec.validation import check_position_limits, max_position_embeddings

_DRAFTING = ("eagle", "flash", "vispec", "specvlm", "draft_vlm")
#: The method keywords ``__call__`` took before methods became configs: keyword -> (config field, methods whose
#: config has it). Passing one raises a ``TypeError`` naming the field (:func:`reject_removed_keywords`).
MOVED_KEYWORDS: MovedKeywords = {name: (name, _DRAFTING)
                                 for name in ("num_draft_tokens", "tree", "draft_confidence_threshold")}
ImageLike = PIL.Image.Image | np.ndarray | torch.Tensor


@dataclass
class VLMStreamChunk:
    """New text of one row after one verification round.

    Attributes:
        row: batch row (prompt index).
        text: the text these tokens added (a detokenised delta; may be "" while a word is incomplete).
        tokens: the new token ids.
        drafted: per new token, True if a draft proposed it and the target accepted it, False if the
            target produced it (corrections, bonus tokens, the first token).
    """

    row: int
    text: str
    tokens: list[int]
    drafted: list[bool]


@dataclass
class VLMPipelineOutput(BaseOutput):
    """Output of :class:`VLMPipeline`.

    Attributes:
        text: the generated text of each prompt (special tokens removed).
        tokens: per prompt, LongTensor ``[L]`` of generated ids (EOS included when it was produced).
        drafted: per prompt, bool ``[L]``: True where the token was drafted and accepted.
        stats: :class:`~mmspec.stats.SpecStats` (mean accepted length includes the bonus token).
        draft_visual_tokens: visual positions the draft head attends to per row (None for "none";
            the full image span for "eagle" and "draft_vlm", fewer for the compressing heads).
    """

    text: list[str]
    tokens: list[torch.Tensor]
    drafted: list[torch.Tensor]
    stats: SpecStats
    draft_visual_tokens: list[int] | None = None


@dataclass
class _Batch:
    """A processed batch: the model inputs plus what the pipeline needs to know about them."""

    inputs: dict[str, torch.Tensor]
    image_counts: list[int] = field(default_factory=list)


class VLMPipeline(MethodSettingsMixin, PretrainedPipelineMixin, PackedCPUGemmMixin, DiffusionPipeline):
    r"""Image/video + text -> text with a transformers VLM, speculative or not, on one core loop.

    Args:
        target: a transformers ``LlavaForConditionalGeneration``, ``LlavaNextForConditionalGeneration``,
            ``Qwen2VLForConditionalGeneration`` or ``Qwen2_5_VLForConditionalGeneration``.
        processor: its transformers processor (tokenizer + image processor; left padding is set here).
        eagle_head / flash_head / vispec_head / specvlm_head: draft heads (``mmspec.models.vlm_drafters``
            or :class:`~mmspec.models.eagle.EagleHead`); each is bound to the target here, which checks its
            hidden size and vocabulary. None: that method is unavailable.
        draft_model: a small VLM of the same family and tokenizer for ``method="draft_vlm"`` (and for
            transformers' assisted generation in the benchmark).

    Methods: ``pipe.methods()`` lists the names ``__call__`` takes; ``pipe.method_config("flash")`` is the
    config a call with ``method="flash"`` uses (the checkpoint's stored settings, :attr:`speculation_settings`,
    read from ``speculation_config.json`` by ``from_pretrained`` and written by ``save_pretrained``), a
    starting point for ``.replace(...)``.

    Loading: ``from_pretrained`` takes a folder, a zoo id or a hub id and diffusers' loading keywords
    (:class:`~mmspec.pipelines.pretrained.PretrainedPipelineMixin`; weights stored in fp16, as the zoo's, are
    computed in float32 unless ``dtype`` says otherwise: exact greedy comparisons, fast on CPU). Loading
    errors name the file and the component; a model with NaN/inf weights is refused unless
    ``check_weights=False``. ``diffusers.DiffusionPipeline.from_pretrained`` loads a saved folder too.
    ``enable_model_cpu_offload()`` (diffusers, needs an accelerator) offloads the target after each call; the
    draft heads and the draft VLM stay on the accelerator.

    Example::

        >>> pipe = VLMPipeline.from_pretrained("mmspec/shapes-vlm")
        >>> out = pipe(image, "describe the image in detail.", method="eagle", max_new_tokens=200)
        >>> out.text[0], out.stats.mean_accepted_length
        >>> shorter = pipe.method_config("eagle").replace(num_draft_tokens=4)  # the stored settings, K changed
        >>> out = pipe(image, "describe the image in detail.", method=shorter)
        >>> for chunk in pipe.stream(image, "describe the image in detail.", method="eagle"):
        ...     print(chunk.text, end="")
    """

    pipeline_family = "vlm"
    _callback_tensor_inputs = ["new_tokens", "drafted"]
    _callback_tensor_fill = {"new_tokens": -1, "drafted": False}  # the other rows of per-prompt calls

    _optional_components = ["eagle_head", "flash_head", "vispec_head", "specvlm_head", "draft_model"]
    # the target verifies every round, the drafters run between rounds: they stay on the accelerator
    model_cpu_offload_seq = "target"
    _exclude_from_cpu_offload = ["eagle_head", "flash_head", "vispec_head", "specvlm_head", "draft_model"]
    default_load_dtype = torch.float32
    extra_pipeline_files = (SETTINGS_FILE,)

    def __init__(self, target: Any, processor: Any, eagle_head: Any = None, flash_head: Any = None,
                 vispec_head: Any = None, specvlm_head: Any = None, draft_model: Any = None) -> None:
        super().__init__()
        self.family = vlm_family(target)  # ValueError for unsupported models
        tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"processor must be a transformers processor with a tokenizer, got {type(processor).__name__}")
        tokenizer.padding_side = "left"
        vocab = target.get_output_embeddings().weight.shape[0]
        if len(tokenizer) > vocab:
            raise ValueError(f"the processor's tokenizer has {len(tokenizer)} tokens but the target predicts {vocab}")
        if draft_model is not None:
            vlm_family(draft_model)
            draft_vocab = draft_model.get_output_embeddings().weight.shape[0]
            if draft_vocab != vocab:
                raise ValueError(f"vocab mismatch: draft_model predicts {draft_vocab} tokens, the target {vocab}")
        self.register_modules(target=target, processor=processor, eagle_head=eagle_head, flash_head=flash_head,
                              vispec_head=vispec_head, specvlm_head=specvlm_head, draft_model=draft_model)
        for name in ("eagle_head", "flash_head", "vispec_head", "specvlm_head"):
            head = getattr(self, name)
            if head is not None:
                bind_head(head, target)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        """The target's end-of-sequence ids (generation config, else the tokenizer's)."""
        config = getattr(self.target, "generation_config", None)
        eos = getattr(config, "eos_token_id", None) if config is not None else None
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])

    # -- inputs ---------------------------------------------------------------------------------------
    def format_prompt(self, text: str, num_images: int) -> str:
        """The model-ready prompt for ``text`` with ``num_images`` images
        (:func:`~mmspec.models.vlm_prompts.format_vlm_prompt`: the chat template when the processor has
        one, else placeholders before the text; a text with placeholders must match the images)."""
        return format_vlm_prompt(self.processor, text, num_images)

    def encode(self, images: Any, prompt: str | Sequence[str], videos: Any = None) -> _Batch:
        """Processor outputs for a batch of (images or video frames, prompt) pairs (left-padded)."""
        prompts, visual, _ = _prompts_and_frames(images, prompt, videos)
        if any(not frames for frames in visual):
            raise ValueError("every prompt needs at least one image (or video frame); got a prompt without any")
        texts = [self.format_prompt(text, len(frames)) for text, frames in zip(prompts, visual)]
        flat = [_to_pil(frame) for frames in visual for frame in frames]
        with shared_lock(self.tokenizer):  # the fast tokenizer's padding settings are shared by all calls
            try:
                inputs = self.processor(text=texts, images=flat, padding=True, return_tensors="pt")
            except (ValueError, TypeError) as error:
                raise ValueError(f"the processor rejected the inputs: {error}") from error
            self._check_known_words(prompts, inputs["input_ids"])
        inputs = {k: v.to(self.target.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].to(self.target.dtype)
        return _Batch(dict(inputs), [len(frames) for frames in visual])

    def _check_known_words(self, prompts: list[str], input_ids: torch.Tensor) -> None:
        """Refuse prompts that the tokenizer can only read as its unknown token (word-level vocabularies such
        as the zoo captioner's): the model would answer a question it never saw. Byte-level tokenizers
        (LLaVA's, Qwen2-VL's) never produce it."""
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if unk is None:
            return
        for index, text in enumerate(prompts):
            if bool((input_ids[index] == unk).any()):
                words = [word.strip(".,;:!?") for word in text.split()]
                unknown = [w for w in words if unk in self.tokenizer(w, add_special_tokens=False)["input_ids"]]
                raise ValueError(f"prompt {index} ({text!r}) reads as the tokenizer's unknown token "
                                 f"{self.tokenizer.unk_token!r}; words outside its vocabulary: {unknown}")

    # -- methods --------------------------------------------------------------------------------------
    def method_config(self, name: str, *, do_sample: bool = False, batch_size: int = 1,
                      guidance_scale: float = 1.0) -> MethodConfig | None:
        """The config a call with ``method=name`` uses for this decoding mode and number of prompts (None for
        "none"); greedy by default, as ``__call__`` is."""
        return super().method_config(name, do_sample=do_sample, batch_size=batch_size, guidance_scale=guidance_scale)

    def position_limits(self, method: str | MethodConfig | None) -> dict[str, int]:
        """``max_position_embeddings`` of the models a call of ``method`` (a name or config) runs over the
        prompt's positions: the target's language model and the method's draft model or head (those that
        declare one; :attr:`~mmspec.methods.vlm_heads.VLMDraftConfig.component`)."""
        component = draft_component(method)
        names = ["target"] + ([component] if component else [])
        limits = {name: max_position_embeddings(getattr(self, name)) for name in names}
        return {name: limit for name, limit in limits.items() if limit is not None}

    def check_context_length(self, batch: _Batch, max_new_tokens: int, method: str | MethodConfig | None) -> None:
        """Refuse a call whose longest prompt (image and video tokens included, as the processor expanded
        them) plus ``max_new_tokens`` exceeds a model's ``max_position_embeddings``: past it the model runs
        without error on positions it never learnt and answers nonsense. Counts tokens, which for M-RoPE
        models (Qwen2-VL; image tokens share positions) bounds the positions from above.

        Raises:
            ValueError: naming the prompt's positions, ``max_new_tokens`` and the limit.
        """
        mask = batch.inputs.get("attention_mask")
        ids = batch.inputs["input_ids"]
        prompt = int(mask.sum(-1).max()) if mask is not None else int(ids.shape[-1])
        check_position_limits(prompt, max_new_tokens, self.position_limits(method))

    def check_inputs(self, method: Any, max_new_tokens: Any, sampling: SamplingConfig, generator: Any) -> None:
        """The checks that need no encoding: the method (a name of this family or one of its configs), the
        generation limit, the sampling settings against the vocabulary and the generator."""
        self.check_method(method)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        sampling.check_vocab(self.target.get_output_embeddings().weight.shape[0])  # top_k=0 disables it, as in the core
        check_generator(generator, "prompt")

    # -- generation -----------------------------------------------------------------------------------
    @inference_call
    def __call__(self, images: Any = None, prompt: str | Sequence[str] = "", method: str | MethodConfig = "none", *,
                 videos: Any = None, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float = 1.0, max_new_tokens: int = 256, generator: torch.Generator | None = None,
                 callback_on_step_end: Callable[[VLMPipeline, int, int, dict[str, Any]], dict] | None = None,
                 callback_on_step_end_tensor_inputs: list[str] | None = None, streamer: Any = None,
                 return_dict: bool = True, **removed: Any) -> VLMPipelineOutput | tuple:
        """Answer each (images or video frames, prompt) pair, speculatively unless ``method="none"``.

        Args:
            images: one image (PIL, ``[H, W, 3]`` array or ``[3, H, W]`` tensor), or one entry per prompt,
                each an image or a list of images.
            prompt: text prompt(s); image placeholder tokens are added by :meth:`format_prompt`.
            method: "none" (target only), a method name (``self.methods()``: "eagle", "flash", "vispec",
                "specvlm", "draft_vlm" and any registered from outside) run with the checkpoint's stored
                settings for this decoding mode and number of prompts (``self.method_config(name, ...)``), or
                a config (``FlashConfig(num_draft_tokens=8)``, ``self.method_config("eagle").replace(tree=...)``)
                run as given. A method's settings (chain length K, an EAGLE-2 tree, the dynamic chain
                length's ``draft_confidence_threshold``) are its config's fields
                (:mod:`mmspec.methods.vlm_heads`); passing one as a keyword here raises a ``TypeError`` that
                names the field.
            videos: instead of ``images``: per prompt a list of frames (the frames enter the prompt as a
                sequence of images, the way the zoo captioner and LLaVA read video).
            do_sample / temperature / top_k / top_p: sampling; greedy decoding when ``do_sample=False``.
            max_new_tokens: generation limit per row (EOS stops a row earlier). The longest prompt (image and
                video tokens included) plus ``max_new_tokens`` must fit the target's and the drafter's
                ``max_position_embeddings``; otherwise ValueError before any forward
                (:meth:`check_context_length`).
            generator: one ``torch.Generator`` for every random draw, or a list, one per prompt: each prompt is
                then answered alone with its own generator, so its answer equals a call for that prompt alone
                (:mod:`.generators`; slower than one batched loop; the callback sees each prompt's own rounds,
                the other rows padded, so :meth:`stream` keeps its rows).
            callback_on_step_end: called after every round in diffusers' convention, ``fn(pipeline, round_index,
                timestep, callback_kwargs) -> dict``; ``timestep`` is the tokens the longest answer has so far and
                ``callback_kwargs`` holds the tensors named in ``callback_on_step_end_tensor_inputs``:
                ``"new_tokens"`` ``[B, M]`` (-1 pad), ``"drafted"`` ``[B, M]`` (default: both). Read-only.
                Setting ``pipeline._interrupt = True`` in it stops the call after that round, as in diffusers:
                the answers so far are returned (with a list of generators, the prompts not started yet get
                their first token only).
            streamer: a transformers streamer (``put(ids)``, ``end()``), batch 1 only. It gets the prompt's ids
                first, then the answer round by round, as from transformers' ``generate`` (so ``skip_prompt``
                works).
            return_dict: False returns the tuple ``(text, tokens, drafted, stats, draft_visual_tokens)``.
        Returns:
            :class:`VLMPipelineOutput` (or the tuple).
        """
        reject_removed_keywords(self, removed, MOVED_KEYWORDS, method)
        # 1. Check the inputs.
        sampling = SamplingConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        self.check_inputs(method, max_new_tokens, sampling, generator)
        step_callback = StepCallback(self, callback_on_step_end, callback_on_step_end_tensor_inputs)
        if isinstance(generator, (list, tuple)):  # each prompt alone with its own random stream
            output = self._per_prompt_calls(images, prompt, method, videos, generator, step_callback, streamer,
                                            dict(do_sample=do_sample, temperature=temperature, top_k=top_k,
                                                 top_p=top_p, max_new_tokens=max_new_tokens))
            return output if return_dict else (output.text, output.tokens, output.drafted, output.stats,
                                               output.draft_visual_tokens)
        # 2. Encode the images and prompts (left-padded).
        batch = self.encode(images, prompt, videos)
        rows = batch.inputs["input_ids"].shape[0]
        if streamer is not None and rows != 1:
            raise ValueError(f"streamer= works for one prompt at a time (got {rows}); use stream() for batches")
        # 3. Resolve the method: the stored or given config builds the drafter; the context must fit its model.
        config, plan = self.build_method(method, BuildRequest(sampling, generator, batch_size=rows))
        self.check_context_length(batch, max_new_tokens, config)  # before any forward
        target = self.target_runner(plan.drafter, config)
        # 4. Run the loop; every accept/reject happens in the core.
        inputs = dict(batch.inputs)
        input_ids, attention_mask = inputs.pop("input_ids"), inputs.pop("attention_mask", None)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if streamer is not None:
            streamer.put(input_ids.cpu())  # the prompt first, as transformers' generate does
        partial, stats = PartialTokens(rows, max_new_tokens, pad), SpecStats()
        with self._round_callback(max_new_tokens, step_callback, streamer, partial) as on_round:
            try:
                out = (plan.loop or speculative_generate)(
                    target, plan.drafter, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                    sampling=sampling, rule=plan.rule, eos_token_id=self.eos_token_ids or None, pad_token_id=pad,
                    generator=generator, stats=stats, callback=on_round, **inputs)
            except PipelineInterrupted:  # pipe._interrupt set by a callback: the answers so far
                out = partial.output(stats, input_ids.device)
        # 5. Decode the text.
        output = self.decode_output(out, config, plan.drafter, target)
        self.maybe_free_model_hooks()  # model CPU offload: every model back to the CPU
        return output if return_dict else (output.text, output.tokens, output.drafted, output.stats,
                                           output.draft_visual_tokens)

    def _per_prompt_calls(self, images: Any, prompt: Any, method: Any, videos: Any, generator: Sequence[Any],
                          step_callback: StepCallback, streamer: Any, sampling: dict[str, Any]) -> VLMPipelineOutput:
        """A call with a list of generators: each prompt answered by its own call with its own generator
        (the answers concatenated in order, the statistics merged)."""
        prompts, visual, name = _prompts_and_frames(images, prompt, videos)
        generators = split_generators(generator, len(prompts), "prompts")
        if streamer is not None and len(prompts) != 1:
            raise ValueError(f"streamer= works for one prompt at a time (got {len(prompts)}); use stream() for "
                             "batches")
        callbacks = row_callbacks(step_callback, len(prompts), self._callback_tensor_fill)
        parts = [self(prompt=[text], method=method, generator=g, callback_on_step_end=callback, streamer=streamer,
                      **{name: [frames]}, **sampling)
                 for text, frames, g, callback in zip(prompts, visual, generators, callbacks)]
        visual_tokens = [p.draft_visual_tokens for p in parts]
        return VLMPipelineOutput(text=[t for p in parts for t in p.text], tokens=[t for p in parts for t in p.tokens],
                                 drafted=[d for p in parts for d in p.drafted],
                                 stats=SpecStats.merge(p.stats for p in parts),
                                 draft_visual_tokens=None if any(v is None for v in visual_tokens)
                                 else [count for v in visual_tokens for count in v])

    def target_runner(self, drafter: Any, config: Any) -> VLMRunner:
        """The target as the loop runs it: with its hidden states when ``drafter`` reads them, and the
        penultimate layer's when the method's ``config`` asks for it."""
        return VLMRunner(self.target, return_hidden=drafter is not None and drafter.needs_target_hidden,
                         return_penultimate=bool(getattr(config, "needs_penultimate", False)))

    @contextmanager
    def _round_callback(self, max_new_tokens: int, step_callback: StepCallback, streamer: Any,
                        partial: PartialTokens) -> Iterator[Callable[[torch.Tensor, torch.Tensor], None]]:
        """The loop's per-round callback: records the round's tokens (``partial``), advances the progress bar
        (by the longest row), feeds the streamer (row 0), calls ``callback_on_step_end`` and then stops the
        loop if the pipeline was interrupted; the streamer is ended once the loop has returned."""
        progress = self.progress_bar(total=max_new_tokens)
        rounds, longest = [0], [0]

        def on_round(new_tokens: torch.Tensor, drafted: torch.Tensor) -> None:
            partial.add(new_tokens, drafted)
            counts = (new_tokens >= 0).sum(1)
            step = int(counts.max())
            progress.update(min(step, max_new_tokens - longest[0]))
            longest[0] = min(max_new_tokens, longest[0] + step)
            if streamer is not None:
                streamer.put(new_tokens[0, : int(counts[0])].cpu())
            if step_callback.active:
                step_callback(rounds[0], longest[0], {"new_tokens": new_tokens, "drafted": drafted})
            rounds[0] += 1
            step_callback.stop_if_interrupted()

        try:
            yield on_round
        finally:
            progress.close()
        if streamer is not None:
            streamer.end()

    def decode_output(self, out: Any, config: MethodConfig | None, drafter: Any, target: VLMRunner
                      ) -> VLMPipelineOutput:
        """The loop's output as text per row, with the drafted flags and the draft-side visual tokens (the
        drafter's own count, else the whole image span for a method that reads it)."""
        rows = out.sequences.shape[0]
        tokens = [out.sequences[i, : int(out.lengths[i])].cpu() for i in range(rows)]
        drafted = [out.drafted[i, : int(out.lengths[i])].cpu() for i in range(rows)]
        text = [self.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
        visual = drafter.draft_visual_tokens if drafter is not None else None
        if visual is None and getattr(config, "reads_whole_image", False) and target.prompt is not None:
            visual = target.prompt.image_mask.sum(1).tolist()
        if isinstance(visual, torch.Tensor):
            visual = visual.tolist()
        return VLMPipelineOutput(text=text, tokens=tokens, drafted=drafted, stats=out.stats,
                                 draft_visual_tokens=visual)

    def stream(self, images: Any = None, prompt: str | Sequence[str] = "", method: str | MethodConfig = "none",
               **kwargs: Any) -> Iterator[VLMStreamChunk | VLMPipelineOutput]:
        """Generate like ``__call__`` and yield text as it is verified.

        Yields a :class:`VLMStreamChunk` per row and round (rows in batch order), then the final
        :class:`VLMPipelineOutput`. Generation runs in a worker thread; errors are re-raised here.
        """
        if "callback_on_step_end" in kwargs or "streamer" in kwargs:
            raise ValueError("stream() sets its own callback: pass neither callback_on_step_end nor streamer")
        events: queue.Queue = queue.Queue()
        decoder = _IncrementalDecoder(self.tokenizer)
        done = object()

        def on_round(pipe: VLMPipeline, index: int, timestep: int, state: dict[str, Any]) -> dict[str, Any]:
            new_tokens, drafted = state["new_tokens"].cpu(), state["drafted"].cpu()
            for row in range(new_tokens.shape[0]):
                keep = new_tokens[row] >= 0
                ids = new_tokens[row][keep].tolist()
                if ids:
                    events.put(VLMStreamChunk(row, decoder.add(row, ids), ids, drafted[row][keep].tolist()))
            return state

        def work() -> None:
            try:
                events.put(self(images, prompt, method, callback_on_step_end=on_round, **kwargs))
            except BaseException as error:  # noqa: BLE001 - handed to the consumer
                events.put(error)
            finally:
                events.put(done)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        while (item := events.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
        worker.join()


class _IncrementalDecoder:
    """Turns per-row token streams into text deltas (decode all, emit the new suffix), so word pieces
    that only become text together are emitted when complete."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}

    def add(self, row: int, ids: list[int]) -> str:
        self.ids.setdefault(row, []).extend(ids)
        text = self.tokenizer.decode(self.ids[row], skip_special_tokens=True)
        previous = self.text.get(row, "")
        self.text[row] = text
        return text[len(previous):] if text.startswith(previous) else text


def _prompts_and_frames(images: Any, prompt: Any, videos: Any) -> tuple[list[str], list[list[Any]], str]:
    """The call's prompts as a list, one list of frames per prompt, and the argument the frames came from
    ("images" or "videos"); a clear ValueError for a prompt that is not a string or for both visual inputs."""
    if not isinstance(prompt, (str, list, tuple)):
        raise ValueError(f"prompt must be a string or a non-empty list of strings, got {type(prompt).__name__}")
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts:
        raise ValueError("prompt must be a string or a non-empty list of strings")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise ValueError(f"every prompt must be a string; prompt {bad[0]} is a {type(prompts[bad[0]]).__name__}")
    if images is not None and videos is not None:
        raise ValueError("pass images or videos, not both (a video is a list of frames)")
    name = "videos" if videos is not None else "images"
    return prompts, _per_prompt(videos if videos is not None else images, len(prompts), name), name


def _per_prompt(visual: Any, num_prompts: int, name: str) -> list[list[Any]]:
    """Normalise images/videos to one list of frames per prompt."""
    if visual is None:
        return [[] for _ in range(num_prompts)]
    if _is_image(visual):
        visual = [visual]
    if not isinstance(visual, (list, tuple)):
        raise ValueError(f"{name} must be an image or a list (one entry per prompt), got {type(visual).__name__}")
    if len(visual) != num_prompts:
        if num_prompts == 1 and name == "images" and all(_is_image(v) for v in visual):
            return [list(visual)]  # several images for one prompt
        raise ValueError(f"{name} has {len(visual)} entries for {num_prompts} prompt(s)")
    frames = [[entry] if _is_image(entry) else list(entry) for entry in visual]
    for item in frames:
        for frame in item:
            if not _is_image(frame):
                raise ValueError(f"{name} entries must be images (PIL, array [H, W, 3] or tensor [3, H, W]), got "
                                 f"{type(frame).__name__}")
    return frames


def _is_image(value: Any) -> bool:
    if isinstance(value, PIL.Image.Image):
        return True
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.ndim == 3
    return False


def _to_pil(image: ImageLike) -> PIL.Image.Image:
    """PIL RGB from PIL, ``[H, W, 3]`` uint8/float array or ``[3, H, W]`` float tensor in [0, 1]."""
    if isinstance(image, PIL.Image.Image):
        return image.convert("RGB")
    array = image.detach().cpu().permute(1, 2, 0).numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"images must be [H, W, 3] arrays or [3, H, W] tensors, got shape {tuple(array.shape)}")
    if array.dtype != np.uint8:
        array = array.astype(np.float32)
        if not np.isfinite(array).all():
            raise ValueError("images contain NaN or infinite values")
        if array.min() < -1e-6 or array.max() > 1 + 1e-6:  # 0-255 floats would otherwise clip to a white image
            raise ValueError(f"float images must be in [0, 1], got values in [{array.min():g}, {array.max():g}] "
                             "(pass uint8 arrays for 0-255)")
        array = (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)
    return PIL.Image.fromarray(array)
