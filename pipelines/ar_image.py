"""Discrete autoregressive image generation with speculative decoding (issue 4).

:class:`ARImagePipeline` composes a LlamaGen-style target (:class:`~mmspec.models.llamagen.LlamaGenTransformer`),
an image tokenizer (``vqvae``: the project's :class:`~mmspec.models.tokenizers.VQTokenizer` or anything with
``decode``, ``codebook_neighbors`` and ``vocab_size``) and an optional EAGLE draft head. Every method is one
call of the core's :func:`~mmspec.speculate.speculative_generate`; the pipeline only builds the target
runner, the drafter and the acceptance rule:

=========  ===================================  =============================================  ==========
method     drafter                              rule (default; ``rule=`` overrides)            lossless
=========  ===================================  =============================================  ==========
"none"     None (target-only baseline)          Exact / Greedy                                 yes
"eagle"    EagleDrafter (chain or EAGLE-2 tree) Exact / Greedy                                 yes
"lantern"  EagleDrafter                         LanternRule(codebook neighbours, k, delta)     no (delta>0)
"sjd"      JacobiDrafter (no draft model)       Exact / Greedy                                 yes
"gsd"      JacobiDrafter                        GroupedRule(G, prob_threshold, embeddings)     no (G>1)
"mulo"     MuLoDrafter (low-res rows, up-sampled) PoolingThresholdRule(neighbours, k, tau)       no
=========  ===================================  =============================================  ==========

"mulo" runs the core's block-wise loop :func:`~mmspec.local_speculate.local_speculative_generate`
(local rejection and resampling of radius-l neighbourhoods) instead of the raster one.

Classifier-free guidance runs the target on a doubled batch ``[cond; uncond]`` through
:class:`~mmspec.runner.GuidedRunner`; drafters see the guided distributions only through verification
(the EAGLE head drafts from the conditional half's features), which keeps every lossless method lossless.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from mmspec.cpu_gemm import PackedCPUGemmMixin
from mmspec.drafters import JacobiDrafter, TreeConfig
from mmspec.inference_mode import inference_call, outside_inference_mode
from mmspec.local_speculate import local_speculative_generate
from mmspec.lookup_tail import LookupTailDrafter
from mmspec.models.llamagen_text import caption_features, check_text_encoder
from mmspec.models.mulo import check_mulo_pair
from mmspec.models.text import WordTokenizer
from mmspec.pipelines.conditioning import (
    WordVocabularyMixin,
    as_prompt_list,
    check_class_labels,
    check_condition,
    images_for_output_type,
    load_text_vocabulary,
)
from mmspec.pipelines.hub import resolve_pretrained
from mmspec.rules import AcceptanceRule, GroupedRule, LanternRule, PoolingThresholdRule
from mmspec.runner import CausalLMRunner, GuidedRunner
from mmspec.sampling import SamplingConfig
from mmspec.speculate import speculative_generate
from mmspec.stats import SpecStats
from mmspec.validation import check_callable, check_guidance_scale

METHODS = ("none", "eagle", "lantern", "sjd", "gsd", "mulo")
OUTPUT_TYPES = ("pil", "np", "pt", "tokens")


@dataclass(frozen=True)
class MethodOptions:
    """The drafting and acceptance keywords of :meth:`ARImagePipeline.__call__` (documented there), handed
    to the method builders as one value."""

    num_draft_tokens: int
    tree: TreeConfig | None
    eagle_guided: bool | str | None
    eagle_blocks: bool | None
    draft_confidence_threshold: float
    argmax_drafts: bool
    lookup_tail: int
    lookup_only_from: int | None
    lantern_k: int | None
    lantern_delta: float
    lantern_lam: float | None
    sjd_window: int
    sjd_init: str
    gsd_group_size: int
    gsd_prob_threshold: float
    gsd_distance_threshold: float
    mulo_k: int
    mulo_tau: float
    mulo_guidance_scale: float | None

    def check_applies_to(self, method: str) -> None:
        """Refuse options that set something ``method`` does not have ("none" ignores drafting options)."""
        eagle = ("none", "eagle", "lantern")
        if self.draft_confidence_threshold and method not in eagle:
            raise ValueError(f"draft_confidence_threshold sets EAGLE chain lengths ('eagle', 'lantern'); "
                             f"method={method!r} drafts no chain")
        if self.mulo_guidance_scale is not None and method not in ("none", "mulo"):
            raise ValueError(f"mulo_guidance_scale guides MuLo-SD's low-res drafter; method={method!r} has none")
        if self.argmax_drafts and method not in ("eagle", "lantern"):
            raise ValueError(f"argmax_drafts chooses EAGLE chain drafts ('eagle', 'lantern'); method={method!r} "
                             f"drafts no EAGLE chain")
        tail = self.lookup_tail
        if not isinstance(tail, int) or isinstance(tail, bool) or tail < 0:
            raise ValueError(f"lookup_tail must be a non-negative integer (0: no tail), got {tail!r}")
        if self.lookup_only_from is not None and not tail:
            raise ValueError("lookup_only_from skips the head in rounds with a long lookup tail: set lookup_tail too")
        if tail and method not in eagle:
            raise ValueError(f"lookup_tail extends EAGLE chains ('eagle', 'lantern'); method={method!r} drafts no "
                             "EAGLE chain")


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


#: The fastest EAGLE / LANTERN chain measured on the shapes zoo when sampling (docs/pipeline_ar_image.md):
#: chains of up to 8 drafts that stop once the head's confidence falls below 0.5. ``mmspec generate`` and
#: the benchmark use it; the pipeline's own defaults stay the conservative fixed K=4.
FAST_EAGLE_CHAIN: dict[str, Any] = {"num_draft_tokens": 8, "draft_confidence_threshold": 0.5}

#: The same for greedy decoding of one image at a time, where rounds accept about 7 drafts and verifying a
#: longer chain costs the CPU almost nothing more (see :func:`fast_method_kwargs`).
FAST_EAGLE_GREEDY_CHAIN: dict[str, Any] = {"num_draft_tokens": 12, "draft_confidence_threshold": 0.5}

#: The same for a head that drafts blocks of K tokens per forward (``num_future`` > 1, greedy): one block
#: (the head's one forward per round), cut at the head's confidence 0.3, then a lookup tail of up to 16
#: copies of the row above while they continue a run of one code (free drafts, no head forward). On the
#: zoo this ran 11-14 % faster than the former chain of up to 12 drafts (three blocks) without a tail,
#: and the tail wins at any chain length; at several images per call it loses. Rounds whose tail, read
#: before drafting, already has 4 copies skip the head and verify the tail alone: another 6-7 %
#: (docs/pipeline_ar_image.md, "Lookup tails").
FAST_EAGLE_BLOCK_GREEDY_CHAIN: dict[str, Any] = {"num_draft_tokens": 4, "draft_confidence_threshold": 0.3,
                                                 "lookup_tail": 16, "lookup_only_from": 4}

#: LANTERN when sampling one image per call with a block-drafting head: argmax drafts (point masses, which
#: the relaxed rule accepts with their relaxed mass p~(x) rather than p~(x) / q(x)) in blocks of K per head
#: forward from the conditional features, the greedy block chain's length and cut. On the zoo at temperature
#: 1 LANTERN++ (lam 3, k 64) then accepts 4.76 tokens per round against 3.86-4.09 with sampled drafts, with
#: 26 head forwards per image against EAGLE's 68 (docs/benchmarks/ar_image_lantern_argmax_cpu.md); with the
#: wider bound lam 10, k 512, 5.42 (docs/benchmarks/ar_image_lantern_wide_cpu.md).
FAST_LANTERN_ARGMAX_BLOCK_CHAIN: dict[str, Any] = {"argmax_drafts": True, **FAST_EAGLE_BLOCK_GREEDY_CHAIN}

#: Chains for several images per call, sampling and greedy: there the CPU forward is compute-bound, every
#: drafted position costs verification time, and shorter chains are faster (batch 4 on the zoo: EAGLE at
#: temperature 1 0.80x / 0.89x / 1.01x / 1.06x of target-only with chains of up to 8 / 6 / 5 / 4, greedy
#: 1.22x / 1.32x / 1.31-1.37x / 1.33x; docs/benchmarks/ar_image_chain_b4_cpu.md). After the round loop got
#: leaner the baseline sped up more than EAGLE, and sampled chains of up to 4 fell to 0.93-0.94x while chains
#: of up to 2 ran at 1.06-1.08x in two screens (docs/benchmarks/ar_image_chain_b4_t1_screen1_cpu.md, _screen2).
FAST_EAGLE_BATCHED_CHAIN: dict[str, Any] = {"num_draft_tokens": 2, "draft_confidence_threshold": 0.5}
FAST_EAGLE_BATCHED_GREEDY_CHAIN: dict[str, Any] = {"num_draft_tokens": 5, "draft_confidence_threshold": 0.5}

#: LANTERN sampling several images per call: the batched chain with argmax drafts, token by token (with
#: several rows the verification, not the head, is the cost; blocks of up to 8 were slower in a screen),
#: from the conditional features (half the head's rows of guided drafts; at batch 4 on the zoo LANTERN++
#: runs at 1.13x of EAGLE's speed, docs/benchmarks/ar_image_lantern_argmax_cpu.md). Chains of up to 4: its
#: relaxed rule keeps long chains (1.23x of target-only against 1.11x with chains of up to 2 at batch 4,
#: docs/benchmarks/ar_image_chain_b4_t1_screen2_cpu.md).
FAST_LANTERN_BATCHED_CHAIN: dict[str, Any] = {"argmax_drafts": True, "num_draft_tokens": 4,
                                              "draft_confidence_threshold": 0.5}

#: The fastest Jacobi window measured on the shapes zoo: 8 slots refilled with copies of the left
#: neighbour. With sampling a copied token is accepted with its target probability, far more often than a
#: uniform random one (the paper's initialisation, the pipeline default), and half the window halves
#: the verify cost on a compute-bound CPU for little lost acceptance.
FAST_JACOBI_WINDOW: dict[str, Any] = {"sjd_window": 8, "sjd_init": "left"}

#: LANTERN's rule when sampling: the LANTERN++ bound lam 10 over the 512 nearest codes (a quarter of the zoo's
#: codebook). With argmax drafts it needed 13.8 target calls per image against 15.3 for lam 3 over 64 codes,
#: at GenEval-shapes 0.904 against EAGLE's 0.840 and with the seeds' images as different from each other
#: (docs/benchmarks/ar_image_lantern_wide_cpu.md); wider still (lam 20, 1024 codes) lost quality and diversity.
FAST_LANTERN_RULE: dict[str, Any] = {"lantern_k": 512, "lantern_lam": 10.0}

#: Per-method settings ``mmspec generate``, the demo and the benchmark use unless told otherwise (lossless
#: ones change speed only; GSD's group of 6 rank neighbours without the probability filter kept
#: GenEval-shapes within noise of target-only at temperature 1, where G=10 did not; MuLo-SD's "reverify"
#: resampling keeps quality near target-only where the paper's parallel resampling collapses on this zoo).
FAST_METHOD_KWARGS: dict[str, dict[str, Any]] = {
    "eagle": FAST_EAGLE_CHAIN,
    "lantern": FAST_EAGLE_CHAIN,
    "sjd": FAST_JACOBI_WINDOW,
    "gsd": {**FAST_JACOBI_WINDOW, "gsd_group_size": 6, "gsd_prob_threshold": 1.0},
    "mulo": {"mulo_resample": "reverify"},
}


def fast_method_kwargs(method: str, greedy: bool = False, batch_size: int = 1, num_future: int = 1,
                       vocab_size: int | None = None) -> dict[str, Any]:
    """The fastest measured settings of ``method`` on the zoo (a fresh dict): :data:`FAST_METHOD_KWARGS`;
    for LANTERN sampling the rule :data:`FAST_LANTERN_RULE` (its ``lantern_k`` capped at ``vocab_size`` - 1
    when the image vocabulary is given, for codebooks smaller than the zoo's);
    for EAGLE / LANTERN chains :data:`FAST_EAGLE_GREEDY_CHAIN` under greedy decoding of a single image
    (:data:`FAST_EAGLE_BLOCK_GREEDY_CHAIN` for a head with ``num_future`` > 1: one block and a lookup tail),
    :data:`FAST_LANTERN_ARGMAX_BLOCK_CHAIN` for LANTERN sampling a single image with such a head, and
    with ``batch_size`` > 1 images per call the shorter :data:`FAST_EAGLE_BATCHED_CHAIN` (sampling; LANTERN
    :data:`FAST_LANTERN_BATCHED_CHAIN`, with argmax drafts) or :data:`FAST_EAGLE_BATCHED_GREEDY_CHAIN`
    (greedy): with several rows the CPU forward is compute-bound and every draft position costs
    verification time."""
    kwargs = dict(FAST_METHOD_KWARGS.get(method, {}))
    if method in ("eagle", "lantern"):
        if batch_size > 1:
            sampled = FAST_LANTERN_BATCHED_CHAIN if method == "lantern" else FAST_EAGLE_BATCHED_CHAIN
            kwargs.update(FAST_EAGLE_BATCHED_GREEDY_CHAIN if greedy else sampled)
        elif greedy:
            kwargs.update(FAST_EAGLE_BLOCK_GREEDY_CHAIN if num_future > 1 else FAST_EAGLE_GREEDY_CHAIN)
        elif method == "lantern" and num_future > 1:
            kwargs.update(FAST_LANTERN_ARGMAX_BLOCK_CHAIN)
    if method == "lantern" and not greedy:
        kwargs.update(FAST_LANTERN_RULE)
        if vocab_size is not None:
            kwargs["lantern_k"] = min(kwargs["lantern_k"], vocab_size - 1)
    return kwargs


def head_num_future(pipe: Any) -> int:
    """Tokens the pipeline's EAGLE heads draft per forward when they draft blocks (its ``eagle_block_head``,
    else its ``eagle_head``; 1: a plain head or none)."""
    head = getattr(pipe, "eagle_block_head", None)
    if head is None:
        head = getattr(pipe, "eagle_head", None)
    return 1 if head is None else int(head.config.get("num_future", 1))


class ARImagePipeline(WordVocabularyMixin, PackedCPUGemmMixin, DiffusionPipeline):
    r"""Text- or class-conditioned discrete AR image generation, speculative or not, on one core loop.

    Args:
        transformer: :class:`~mmspec.models.llamagen.LlamaGenTransformer` (c2i or t2i with a word table).
        vqvae: image tokenizer with ``decode(tokens [B, h, w]) -> images [B, 3, H, W]`` in [0, 1],
            ``codebook_neighbors(k)`` and ``vocab_size`` (:class:`~mmspec.models.tokenizers.VQTokenizer`).
        eagle_head: :class:`~mmspec.models.eagle.EagleHead` for "eagle" / "lantern" (None: those methods
            are unavailable). It is bound to the transformer's embeddings and LM head here.
        eagle_block_head: optional second :class:`~mmspec.models.eagle.EagleHead` with ``num_future`` K > 1
            (FLASH's readout: K drafts per forward), used for greedy chains (``eagle_blocks``); the
            ``eagle_head`` keeps drafting token by token where that is faster (sampling, trees).
        mulo_drafter / mulo_upsampler: MuLo-SD's low-resolution AR model (the target's condition
            interface, ``block_size`` = the target's / r^2) and its
            :class:`~mmspec.models.mulo.TokenUpsampler` (None: "mulo" is unavailable).
        text_tokenizer: word vocabulary of a t2i model with ``text_vocab_size`` (a
            :class:`~mmspec.models.text.WordTokenizer`); saved as ``transformer/text_vocab.json``.
        text_encoder / tokenizer: a t2i model that reads caption features (LlamaGen's official t2i
            checkpoints: ``text_vocab_size=None``) gets them from this transformers encoder (T5) and its
            tokenizer, in LlamaGen's layout (:mod:`mmspec.models.llamagen_text`).

    ``vqvae.decode`` gives images in ``vqvae.decode_range`` (default ``(0, 1)``; LlamaGen's VQ: ``(-1, 1)``),
    mapped to [0, 1] for the outputs.

    Example::

        >>> pipe = ARImagePipeline.from_pretrained("mmspec/shapes-t2i")
        >>> out = pipe("a red circle", method="eagle", generator=torch.Generator().manual_seed(0))
        >>> out.images[0], out.stats.mean_accepted_length, out.drafted_overlay()[0]
    """

    _optional_components = ["eagle_head", "mulo_drafter", "mulo_upsampler", "text_encoder", "tokenizer",
                            "eagle_block_head"]

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

    # -- loading and saving ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> ARImagePipeline:
        """Load a saved pipeline folder or a zoo id (``mmspec/shapes-t2i``, offline, see
        :func:`resolve_pretrained`); the word vocabulary is read from ``transformer/text_vocab.json``."""
        path = resolve_pretrained(pretrained_model_name_or_path)
        load_text_vocabulary(path, kwargs)
        if (Path(path) / "model_index.json").is_file():
            names = ("transformer", "vqvae", "eagle_head", "mulo_drafter", "mulo_upsampler", "text_encoder",
                     "tokenizer", "eagle_block_head")
            return cls._from_saved_folder(Path(path), names, **kwargs)
        return super().from_pretrained(path, **kwargs)

    @classmethod
    def _complete_components(cls, components: dict[str, Any], path: Path) -> dict[str, Any]:
        """Without a word vocabulary file, the text tokenizer comes from the transformer's
        ``load_text_tokenizer`` hook when it has one (Janus: an HF tokenizer)."""
        hook = getattr(components["transformer"], "load_text_tokenizer", None)
        if components.get("text_tokenizer") is None and callable(hook):
            components["text_tokenizer"] = hook(path / "transformer")
        return components

    # -- helpers --------------------------------------------------------------------------------------
    @property
    def grid_size(self) -> int:
        return int(round(self.transformer.config.block_size ** 0.5))

    def codebook_neighbors(self, k: int) -> torch.Tensor:
        """``vqvae.codebook_neighbors(k)`` computed once (for the largest k asked so far) and cached."""
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
            features, mask = caption_features(prompt, self.tokenizer, self.text_encoder, length)
            features, mask = self.transformer.pad_condition(features.to(device), mask.to(device))
            return {"condition_embeds": features}, mask.to(device)
        ids = self.text_tokenizer.batch(prompt, length)
        return {"condition_ids": ids.to(device)}, (ids >= 0).long().to(device)

    def check_inputs(self, prompt: Any, class_labels: Any, method: str, do_sample: bool, top_k: int | None,
                     guidance_scale: float, num_images_per_prompt: int, output_type: str,
                     rule: AcceptanceRule | None, generator: Any) -> None:
        config = self.transformer.config
        if method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
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
        if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be a positive integer, got {num_images_per_prompt!r}")
        vocab = config.vocab_size
        if top_k is not None and top_k > vocab:
            raise ValueError(f"top_k={top_k} is larger than the image vocabulary ({vocab} tokens)")
        if not guidance_scale >= 0:
            raise ValueError(f"guidance_scale must be >= 0, got {guidance_scale}")
        if guidance_scale != 1.0 and not config.class_dropout_prob > 0:
            raise ValueError(f"guidance_scale={guidance_scale} needs an unconditional model (a transformer trained "
                             "with class_dropout_prob > 0); this one has none: use guidance_scale=1.0")
        if method in ("eagle", "lantern") and self.eagle_head is None and self.eagle_block_head is None:
            raise ValueError(f"method={method!r} needs an eagle_head; this pipeline has none")
        if method == "mulo" and (self.mulo_drafter is None or self.mulo_upsampler is None):
            raise ValueError("method='mulo' needs mulo_drafter and mulo_upsampler; this pipeline lacks them")
        if rule is not None:
            if not isinstance(rule, AcceptanceRule):
                raise ValueError(f"rule must be an AcceptanceRule, got {type(rule).__name__}")
            if rule.greedy == do_sample:
                raise ValueError(f"rule.greedy={rule.greedy} contradicts do_sample={do_sample}: build the rule with "
                                 f"greedy={not do_sample}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError("generator must be one torch.Generator (lists of generators are not supported)")

    def _drafting_head(self, blocks: bool) -> Any:
        """The EAGLE head that drafts: ``eagle_block_head`` for blocks when the pipeline has one, else
        ``eagle_head`` (itself drafting blocks if it has ``num_future`` > 1 and ``blocks``)."""
        if blocks and self.eagle_block_head is not None:
            return self.eagle_block_head
        if self.eagle_head is None:
            raise ValueError("token-by-token EAGLE drafting (sampling, eagle_blocks=False or a tree) needs an "
                             "eagle_head; this pipeline has only an eagle_block_head")
        return self.eagle_head

    def _eagle_mode(self, head: Any, eagle_guided: bool | str | None, guidance_scale: float, deterministic: bool
                    ) -> bool | str:
        """How the EAGLE head drafts under guidance: "features" (one row of guided features, for a head
        trained on them at this scale), True (both halves, logits combined) or False (conditional half).
        ``deterministic``: the chain drafts argmax tokens (greedy decoding or ``argmax_drafts``)."""
        trained_scale = head.config.get("feature_guidance")  # None: trained on plain features
        fits = guidance_scale != 1.0 and trained_scale == guidance_scale
        if eagle_guided is None:  # auto; otherwise guided drafts for sampled ones, the conditional half's for argmax
            return "features" if fits else not deterministic
        if eagle_guided == "features":
            if not fits:
                raise ValueError(f"eagle_guided='features' needs a head trained on guided features at this "
                                 f"guidance_scale ({guidance_scale}); this head's feature_guidance is {trained_scale}")
            return "features"
        if not isinstance(eagle_guided, bool):
            raise ValueError(f"eagle_guided must be None, True, False or 'features', got {eagle_guided!r}")
        return eagle_guided

    def _build_method(self, method: str, sampling: SamplingConfig, generator: torch.Generator | None,
                      guidance_scale: float, rows: int, options: MethodOptions) -> tuple[Any, AcceptanceRule | None]:
        """The drafter and (when the method has its own) the acceptance rule of ``method`` for ``rows``
        images per call."""
        options.check_applies_to(method)
        if method == "none":
            return None, None
        if method in ("eagle", "lantern"):
            return self._eagle_method(method, sampling, generator, guidance_scale, rows, options)
        if method in ("sjd", "gsd"):
            return self._jacobi_method(method, sampling, generator, options)
        return self._mulo_method(sampling, generator, guidance_scale, options)

    def _eagle_method(self, method: str, sampling: SamplingConfig, generator: torch.Generator | None,
                      guidance_scale: float, rows: int, o: MethodOptions) -> tuple[Any, AcceptanceRule | None]:
        """EAGLE drafts (chain, tree or blocks, with a lookup tail); LANTERN's relaxed rule for "lantern"."""
        from mmspec.models.eagle import EagleDrafter

        greedy = not sampling.do_sample
        vocab = self.transformer.config.vocab_size
        if o.eagle_blocks is not None and not isinstance(o.eagle_blocks, bool):
            raise ValueError(f"eagle_blocks must be None, True or False, got {o.eagle_blocks!r}")
        deterministic = greedy or o.argmax_drafts
        blocks = (deterministic and o.tree is None and rows == 1) if o.eagle_blocks is None else o.eagle_blocks
        head = self._drafting_head(blocks)
        mode = self._eagle_mode(head, o.eagle_guided, guidance_scale, deterministic)
        drafter = EagleDrafter(head, o.num_draft_tokens, sampling=sampling, tree=o.tree, generator=generator,
                               guidance_scale=guidance_scale if mode is True else 1.0,
                               confidence_threshold=o.draft_confidence_threshold,
                               guided_features=mode == "features", blocks=blocks, argmax_drafts=o.argmax_drafts)
        if o.lookup_tail:
            if o.tree is not None:
                raise ValueError("lookup_tail extends draft chains: pass tree=None (an EAGLE-2 tree has no tail)")
            drafter = LookupTailDrafter(drafter, o.lookup_tail, offset=self.grid_size, vocab_size=vocab,
                                        lookup_only_from=o.lookup_only_from,
                                        max_length=self.transformer.config.block_size)
        if method == "eagle":
            return drafter, None
        k = min(1000, vocab - 1) if o.lantern_k is None else o.lantern_k
        if not isinstance(k, int) or not 1 <= k <= vocab - 1:
            raise ValueError(f"lantern_k must be an integer in [1, {vocab - 1}], got {o.lantern_k!r}")
        rule = LanternRule(self.codebook_neighbors(k), k=k, delta=o.lantern_delta, lam=o.lantern_lam, greedy=greedy)
        return drafter, rule

    def _jacobi_method(self, method: str, sampling: SamplingConfig, generator: torch.Generator | None,
                       o: MethodOptions) -> tuple[Any, AcceptanceRule | None]:
        """Speculative Jacobi decoding; GSD's grouped rule for "gsd"."""
        drafter = JacobiDrafter(self.transformer.config.vocab_size, window=o.sjd_window, sampling=sampling,
                                init=o.sjd_init, generator=generator)
        if method == "sjd":
            return drafter, None
        rule = GroupedRule(G=o.gsd_group_size, prob_threshold=o.gsd_prob_threshold,
                           embeddings=self.codebook_embeddings(), distance_threshold=o.gsd_distance_threshold,
                           greedy=not sampling.do_sample)
        return drafter, rule

    def _mulo_method(self, sampling: SamplingConfig, generator: torch.Generator | None, guidance_scale: float,
                     o: MethodOptions) -> tuple[Any, AcceptanceRule]:
        """MuLo-SD's low-res drafter and up-sampler with the pooled threshold rule."""
        from mmspec.models.mulo import MuLoDrafter

        vocab = self.transformer.config.vocab_size
        if not isinstance(o.mulo_k, int) or not 1 <= o.mulo_k <= vocab - 1:
            raise ValueError(f"mulo_k must be an integer in [1, {vocab - 1}], got {o.mulo_k!r}")
        draft_scale = guidance_scale if o.mulo_guidance_scale is None else o.mulo_guidance_scale
        check_guidance_scale(draft_scale, "mulo_guidance_scale")
        if guidance_scale == 1.0 and draft_scale != 1.0:
            raise ValueError(f"mulo_guidance_scale={draft_scale} needs a guided target (guidance_scale != 1): "
                             "the drafter's unconditional rows come from the target's guided prompt batch")
        drafter = MuLoDrafter(self.mulo_drafter, self.mulo_upsampler, self.vqvae, sampling=sampling,
                              guidance_scale=float(draft_scale), generator=generator,
                              guided_prompt=guidance_scale != 1.0)
        rule = PoolingThresholdRule(self.codebook_neighbors(o.mulo_k), k=o.mulo_k, tau=o.mulo_tau,
                                    greedy=not sampling.do_sample)
        return drafter, rule

    # -- generation -----------------------------------------------------------------------------------
    @inference_call
    def __call__(self, prompt: str | list[str] | None = None, class_labels: int | list[int] | torch.Tensor | None = None,
                 method: str = "none", *, do_sample: bool = True, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float = 1.0, guidance_scale: float = 3.0, num_images_per_prompt: int = 1,
                 generator: torch.Generator | None = None, output_type: str = "pil", num_draft_tokens: int = 4,
                 tree: TreeConfig | None = None, lantern_k: int | None = None, lantern_delta: float = 0.1,
                 lantern_lam: float | None = None, sjd_window: int = 16, sjd_init: str = "random",
                 gsd_group_size: int = 10, gsd_prob_threshold: float = 0.15,
                 gsd_distance_threshold: float = float("inf"), mulo_k: int = 16, mulo_tau: float = 0.3,
                 mulo_radius: int = 1, mulo_resample: str = "parallel", mulo_guidance_scale: float | None = None,
                 eagle_guided: bool | str | None = None,
                 draft_confidence_threshold: float = 0.0, eagle_blocks: bool | None = None,
                 argmax_drafts: bool = False, lookup_tail: int = 0, lookup_only_from: int | None = None,
                 rule: AcceptanceRule | None = None,
                 callback_on_step_end: Callable[[ARImagePipeline, int, dict[str, torch.Tensor]], Any] | None = None,
                 ) -> ARImagePipelineOutput:
        """Generate images token by token, speculatively unless ``method="none"``.

        Args:
            prompt: text prompt(s) (t2i models); class_labels: class id(s) (c2i models). Exactly one.
            method: "none", "eagle", "lantern", "sjd", "gsd", "mulo".
            do_sample / temperature / top_k / top_p: how the (guided) logits become distributions; greedy
                decoding when ``do_sample=False``.
            guidance_scale: classifier-free guidance (1.0: no guidance, no doubled batch).
            num_images_per_prompt: images per prompt (rows ``prompt0 x n, prompt1 x n, ...``).
            generator: one ``torch.Generator`` for every random draw (drafts, acceptance, resampling).
            output_type: "pil", "np", "pt" or "tokens" (no decoding).
            num_draft_tokens / tree: EAGLE chain length, or an EAGLE-2 :class:`~mmspec.drafters.TreeConfig`.
            eagle_guided: under guidance, run the EAGLE head on both halves and draft from the guided
                combination of its logits (True), draft from the conditional half only (False), or draft one
                row from the target's guided features ("features": a head trained on them at this guidance
                scale, ``feature_guidance`` in its config). None (default) picks "features" for such a head,
                else guided for sampled drafts and conditional for argmax ones (greedy decoding or
                ``argmax_drafts``: the head's unconditional errors, amplified by s - 1, cost the acceptance of
                argmax drafts; docs/pipeline_ar_image.md).
            eagle_blocks: draft blocks of K tokens per head forward (True) with the ``eagle_block_head`` (or an
                ``eagle_head`` with ``num_future`` K > 1), or token by token with the ``eagle_head`` (False; a
                K-future head then reads its first future). None (default): blocks for argmax chains (greedy
                decoding or ``argmax_drafts``) of one image per call, tokens for sampled drafts, for several
                images per call or a tree (a block's later drafts are guesses made without the drafts before
                them, which costs a sampled chain more than an argmax one, and with several rows the
                verification, not the head, is the cost; docs/pipeline_ar_image.md). Without a block-drafting head every chain is token by token.
            draft_confidence_threshold: dynamic EAGLE chain length: a round's chain stops before K once
                every row's drafted token had less than this probability under the head (0: always K).
                Lossless like any chain length; it saves head forwards whose drafts would mostly be
                rejected (docs/pipeline_ar_image.md).
            argmax_drafts: when sampling, EAGLE chains draft the head's most likely token instead of a sampled
                one (point-mass proposals: "eagle" stays lossless, accepting a draft with probability p(x);
                "lantern" accepts it with its relaxed mass p~(x), the neighbours' mass in full). With LANTERN
                it accepts more tokens per target call than sampled drafts on the zoo
                (docs/pipeline_ar_image.md); greedy decoding drafts argmax anyway.
            lookup_tail: free drafts after every EAGLE chain ("eagle", "lantern"): this many tokens, each a copy
                of the token one grid row above it (:class:`~mmspec.lookup_tail.LookupTailDrafter`). They cost
                no head forward, only their verification; point-mass proposals, so "eagle" stays lossless
                (docs/pipeline_ar_image.md, "Lookup tails"). 0 (default): none. Chains only (no ``tree``).
            lookup_only_from: with ``lookup_tail``, a round whose lookup tail (read from the committed tokens
                before drafting) has at least this many tokens skips the head and verifies the tail alone
                (one image per call; with several the head drafts every round). None (default): the head
                drafts every round.
            lantern_k / lantern_delta / lantern_lam: LANTERN neighbourhood size (default min(1000, V - 1)),
                TV budget, LANTERN++ bound (when given, delta is ignored).
            sjd_window / sjd_init: Jacobi window length and initialisation ("random" or "left").
            gsd_group_size / gsd_prob_threshold / gsd_distance_threshold: GSD group size G, |p(y) - p(x)|
                filter, codebook-distance filter.
            mulo_k / mulo_tau / mulo_radius: MuLo-SD pooled threshold (a draft is kept when the target mass
                of it and its k nearest codebook neighbours reaches tau) and local resampling radius l.
            mulo_resample: "parallel" (the paper's: redrawn tokens from the block's one target pass),
                "sequential" (in raster order, each given the final tokens before it; one more target
                call per redrawn column) or "reverify" (drafts kept up to the first rejection, which is
                redrawn; the rest of the block is refined and verified again by Jacobi passes; lossless
                with an exact ``rule``),
                see :func:`~mmspec.local_speculate.local_speculative_generate`.
            mulo_guidance_scale: classifier-free guidance of MuLo-SD's low-res drafter (None: the target's
                ``guidance_scale``; 1.0 under a guided target: the drafter reads the conditional prompt rows
                and drafts unguided, at half the rows). Drafts only: the target's guidance decides acceptance.
            rule: an :class:`~mmspec.rules.AcceptanceRule` replacing the method's (e.g. ``GroupedRule`` on
                EAGLE drafts); its ``greedy`` flag must equal ``not do_sample``.
            callback_on_step_end: called after every verification round as ``fn(pipeline, round_index,
                {"new_tokens": [B, M] (-1 pad), "drafted": [B, M], "num_generated": [B]})``.
        Returns:
            :class:`ARImagePipelineOutput`.
        """
        self.check_inputs(prompt, class_labels, method, do_sample, top_k, guidance_scale, num_images_per_prompt,
                          output_type, rule, generator)
        check_callable(callback_on_step_end, "callback_on_step_end")
        config = self.transformer.config
        device = self.transformer.device
        sampling = SamplingConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        # 1. Condition rows: word ids or caption features [B, C(, D)] (t2i) or [B] class ids (c2i), per image.
        if prompt is not None:
            condition, mask = self.encode_prompt([prompt] if isinstance(prompt, str) else list(prompt), device)
        else:
            condition = {"condition_ids": torch.as_tensor(class_labels, dtype=torch.long, device=device).reshape(-1)}
            mask = torch.ones(condition["condition_ids"].shape[0], 1, dtype=torch.long, device=device)
        (name, values), = condition.items()
        values = values.repeat_interleave(num_images_per_prompt, 0)
        mask = mask.repeat_interleave(num_images_per_prompt, 0)
        batch = values.shape[0]
        options = MethodOptions(
            num_draft_tokens=num_draft_tokens, tree=tree, eagle_guided=eagle_guided, eagle_blocks=eagle_blocks,
            draft_confidence_threshold=draft_confidence_threshold, argmax_drafts=argmax_drafts,
            lookup_tail=lookup_tail, lookup_only_from=lookup_only_from, lantern_k=lantern_k,
            lantern_delta=lantern_delta, lantern_lam=lantern_lam, sjd_window=sjd_window, sjd_init=sjd_init,
            gsd_group_size=gsd_group_size, gsd_prob_threshold=gsd_prob_threshold,
            gsd_distance_threshold=gsd_distance_threshold, mulo_k=mulo_k, mulo_tau=mulo_tau,
            mulo_guidance_scale=mulo_guidance_scale)
        drafter, method_rule = self._build_method(method, sampling, generator, guidance_scale, batch, options)
        rule = rule if rule is not None else method_rule

        # 2. Target: the transformer, with a doubled [cond; uncond] batch under guidance.
        target: Any = CausalLMRunner(self.transformer,
                                     return_hidden=bool(getattr(drafter, "needs_target_hidden", False)))
        inputs: dict[str, torch.Tensor] = {name: values}
        if guidance_scale != 1.0:
            target = GuidedRunner(target, guidance_scale, hidden=getattr(drafter, "target_hidden", "cond"))
            inputs = {name: torch.cat([values, values]),
                      "condition_drop": GuidedRunner.condition_drop(batch, device)}
            mask = torch.cat([mask, mask])  # unconditional rows keep their prompt's layout, as LlamaGen's sampler

        # 3. Decode block_size tokens per row; every accept/reject happens in the core.
        tokens_per_image = config.block_size
        progress = self.progress_bar(total=batch * tokens_per_image)
        generated = [0] * batch  # per image, on the host (this runs every round)
        rounds = [0]

        def on_round(new_tokens: torch.Tensor, drafted: torch.Tensor) -> None:
            before = sum(generated)
            for row, gained in enumerate((new_tokens >= 0).sum(1).tolist()):
                generated[row] = min(generated[row] + gained, tokens_per_image)
            progress.update(sum(generated) - before)
            if callback_on_step_end is not None:
                callback_on_step_end(self, rounds[0], {"new_tokens": new_tokens, "drafted": drafted,
                                                       "num_generated": torch.tensor(generated)})
            rounds[0] += 1

        grid = self.grid_size
        if method == "mulo":
            ratio = self.mulo_upsampler.config.ratio
            out = local_speculative_generate(
                target, drafter, (grid, grid), block_rows=ratio, radius=mulo_radius, attention_mask=mask,
                sampling=sampling, rule=rule, generator=generator, resample=mulo_resample,
                callback=lambda block, tokens, drafted: on_round(tokens, drafted), **inputs)
        else:
            out = speculative_generate(target, drafter, None, mask, max_new_tokens=tokens_per_image, sampling=sampling,
                                       rule=rule, generator=generator, callback=on_round, **inputs)
        progress.close()

        # 4. Token grid, drafted map, decoding.
        tokens = out.sequences.reshape(batch, grid, grid)
        drafted = out.drafted.reshape(batch, grid, grid)
        images: Any = None
        if output_type != "tokens":
            low, high = getattr(self.vqvae, "decode_range", (0.0, 1.0))
            pixels = ((self.vqvae.decode(tokens).float() - low) / (high - low)).clamp(0.0, 1.0)  # [B, 3, H, W]
            images = images_for_output_type(pixels, output_type)
        return ARImagePipelineOutput(images=images, tokens=tokens, stats=out.stats, drafted=drafted)

