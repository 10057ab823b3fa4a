"""Continuous-token AR image generation (MAR) with continuous speculative decoding (CSpD, issue 6).

:class:`ContinuousARImagePipeline` runs a MAR-style target (:class:`~mmspec.models.mar.MARModel`: ViT
encoder/decoder over a random generation order, a diffusion MLP head per token) target-only
(``method="none"``) or with CSpD (``method="cspd"``, Wang et al. 2024, https://arxiv.org/abs/2411.11925)
and a smaller draft MAR of the same family. Every accept/reject decision goes through the core:
:func:`mmspec.continuous.cspd_log_ratio` gives the trajectory-aligned surrogate ratio and
:func:`mmspec.continuous.verify_continuous` accepts (in log space) and draws the residual.

How CSpD's draft/target passes map onto MAR's masked-set iterations (full account in
docs/pipeline_continuous.md):

* **Schedule.** MAR's cosine schedule splits the generation order into ``num_iter`` sets; iteration s
  predicts order positions ``[c_s, c_{s+1})`` from the ``c_s`` tokens generated before it (its
  *context*), with guidance ``1 + (g - 1) (L - mask_len_s) / L`` (MAR's linear schedule). A token's
  context and guidance are fixed by the schedule, whatever method generates it.
* **Noise.** Every token owns its noise (``[T, C]``, drawn once per call for every grid position), and
  every denoising chain that samples that token, draft or target, uses it (trajectory alignment). So
  the target-only run and CSpD consume the same random numbers for the same token.
* **Pre-filling.** The target runs whole iterations until ``ceil(prefill_ratio * L)`` tokens exist.
* **Round.** The draft runs ``draft_length`` (gamma) MAR iterations, each a full draft forward plus its
  diffusion chain on that iteration's set, recording every step's Gaussian; then **one** target forward
  call scores all the drafted tokens, its head runs every drafted token's chain with the same noise,
  and the core verifies. With ``num_iter = L`` (one token per iteration, MAR's evaluation setting)
  gamma iterations are the next gamma tokens of the generation order.
* **Target context** (``verify_context``): ``"round"`` (the official code): one target row per image,
  conditioned on the tokens that existed when the round began, so one forward costs one iteration;
  later draft iterations saw drafted tokens the target row does not, so even an identical draft is not
  always accepted when gamma > 1. ``"exact"``: one target row per draft iteration, each conditioned on
  exactly that iteration's context, all rows in one batched forward call (gamma times the rows): each
  token is verified against the distribution a target-only run would have sampled it from.
* **Verification order** (``verify_order``): ``"chain"`` (the paper) commits the leading accepted run
  and the first rejected token's residual sample and discards the rest of the round; ``"iteration"``
  commits every drafted MAR iteration up to and including the first one with a rejection (its tokens
  were sampled in parallel from one context, so keeping all of them, residuals for the rejected, is as
  consistent as the token chain and commits more; with one token per iteration it is ``"chain"``);
  ``"independent"`` (the official code) verifies every drafted token on its own and commits all of them (accepted drafts,
  residual samples for the rejected).

With ``verify_context="exact"`` (any order), or ``"round"`` with ``draft_length=1``, a draft identical
to the target is accepted everywhere (log ratio 0) and the images equal ``method="none"``'s exactly.
"""

from __future__ import annotations

import math
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

from mmspec.continuous import cspd_log_ratio_terms, gaussian_log_prob, verify_continuous
from mmspec.cpu_gemm import PackedCPUGemmMixin
from mmspec.inference_mode import inference_call
from mmspec.models.text import WordTokenizer
from mmspec.pipelines.conditioning import (
    WordVocabularyMixin,
    as_prompt_list,
    check_class_labels,
    check_condition,
    images_for_output_type,
)
from mmspec.pipelines.hub import resolve_pretrained
from mmspec.stats import SpecStats
from mmspec.validation import (
    MAX_NOISE_TEMPERATURE,
    NonFiniteValuesError,
    check_callable,
    check_guidance_scale,
    check_temperature,
)

METHODS = ("none", "cspd")
OUTPUT_TYPES = ("pil", "np", "pt", "latent")
VERIFY_ORDERS = ("chain", "iteration", "independent")
VERIFY_CONTEXTS = ("round", "exact")
CFG_SCHEDULES = ("linear", "constant")
#: Largest ``density_temperature`` accepted: the official code's "inner temperature" is about 42-50, and the
#: acceptance densities' variances grow with its square (1e6 at most: finite in float32 and bfloat16).
DENSITY_TEMPERATURE_MAX = 1e3


# ----------------------------------------------------------------------------------------------------
# outputs and statistics
# ----------------------------------------------------------------------------------------------------


@dataclass
class CSpDStats(SpecStats):
    """:class:`~mmspec.stats.SpecStats` plus CSpD's counters.

    ``verify_steps`` / ``emitted`` count every (row, target forward), pre-filling and target-only
    iterations included, so ``mean_accepted_length`` is the tokens a row gains per target forward
    (``L / num_iter`` for ``method="none"``: a MAR iteration already yields a set).

    Attributes:
        drafted_tokens: drafted tokens that were verified (chain order: up to the first rejection).
        accepted_tokens: of those, accepted.
        residual_fallbacks: rejected tokens whose residual sampling ran out of tries (they keep a plain
            draw from the target's last-step Gaussian).
        prefill_tokens: tokens generated by the target before drafting started (all rows).
    """

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    residual_fallbacks: int = 0
    prefill_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """The paper's alpha: accepted / verified drafted tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @classmethod
    def merge(cls, parts: Any) -> CSpDStats:
        parts = list(parts)
        total = super().merge(parts)
        for name in ("drafted_tokens", "accepted_tokens", "residual_fallbacks", "prefill_tokens"):
            setattr(total, name, sum(getattr(p, name, 0) for p in parts))
        return total

    def as_dict(self) -> dict:
        return {**super().as_dict(), "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": self.acceptance_rate, "residual_fallbacks": self.residual_fallbacks,
                "prefill_tokens": self.prefill_tokens}


@dataclass
class ContinuousARImagePipelineOutput(BaseOutput):
    """Output of :class:`ContinuousARImagePipeline`.

    Attributes:
        images: PIL list ("pil"), float32 array ``[B, H, W, 3]`` in [0, 1] ("np"), tensor ``[B, 3, H, W]``
            ("pt"), or None ("latent").
        tokens: ``[B, h, w, C]`` the continuous tokens (the tokenizer's latents).
        stats: :class:`CSpDStats` of the call.
        drafted: bool ``[B, h, w]``: True where the token is an accepted draft.
    """

    images: list[PIL.Image.Image] | np.ndarray | torch.Tensor | None
    tokens: torch.Tensor
    stats: CSpDStats
    drafted: torch.Tensor


# ----------------------------------------------------------------------------------------------------
# schedule and densities
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MARSchedule:
    """MAR's iteration schedule over ``seq_len`` tokens.

    Attributes:
        starts: ``[N + 1]`` cumulative counts: iteration s predicts order positions ``[starts[s], starts[s+1])``
            from the ``starts[s]`` tokens before them.
        mask_lens: ``[N]`` MAR's ``mask_len`` of each iteration (tokens still masked after it; 1 at the
            last iteration, as in MAR), which sets the linear guidance schedule.
    """

    starts: tuple[int, ...]
    mask_lens: tuple[int, ...]

    @property
    def num_iterations(self) -> int:
        return len(self.mask_lens)

    def guidance(self, scale: float, schedule: str, seq_len: int) -> list[float]:
        """Guidance scale of every iteration: MAR's linear ramp ``1 + (g - 1) (L - mask_len) / L`` or constant."""
        if schedule == "constant":
            return [scale] * self.num_iterations
        return [1 + (scale - 1) * (seq_len - m) / seq_len for m in self.mask_lens]

    def iteration_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Iteration index of order positions (any shape)."""
        bounds = torch.tensor(self.starts[1:], device=positions.device)
        return torch.bucketize(positions, bounds, right=True)


def mar_schedule(seq_len: int, num_iter: int) -> MARSchedule:
    """MAR's cosine masking schedule (MaskGIT/MAGE): after iteration s, ``floor(L cos(pi/2 (s+1)/N))``
    tokens stay masked, clamped so every iteration predicts at least one token; the last predicts the
    rest. Iterations that would predict nothing cannot occur for ``num_iter <= seq_len``."""
    if not isinstance(num_iter, int) or not 1 <= num_iter <= seq_len:
        raise ValueError(f"num_iter must be an integer in [1, {seq_len}] (tokens per image), got {num_iter!r}")
    starts, mask_lens, remaining = [0], [], seq_len
    for step in range(num_iter):
        mask_len = int(np.floor(seq_len * np.cos(math.pi / 2.0 * (step + 1) / num_iter)))
        mask_len = max(1, min(remaining - 1, mask_len))
        predicted_until = seq_len if step == num_iter - 1 else seq_len - mask_len
        starts.append(predicted_until)
        mask_lens.append(mask_len)
        remaining = seq_len - predicted_until
    return MARSchedule(tuple(starts), tuple(mask_lens))


class LastStepGaussian:
    """The last denoising step's diagonal Gaussian of a chain, as a distribution-like object for
    :func:`~mmspec.continuous.verify_continuous`.

    ``loc``/``scale`` are what the core samples residual proposals from (``loc + scale * eps``);
    ``log_prob`` evaluates the density with the standard deviation multiplied by ``density_temperature``
    (1: the plain Gaussian; the official code's "inner temperature" otherwise) plus ``log_offset`` (the
    target side carries CSpD's log-determinant sum over the earlier steps).
    """

    def __init__(self, loc: torch.Tensor, variance: torch.Tensor, density_temperature: float = 1.0,
                 log_offset: torch.Tensor | float = 0.0) -> None:
        self.loc = loc
        self.scale = variance.sqrt()
        self.density_variance = variance * density_temperature ** 2
        self.log_offset = log_offset

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return gaussian_log_prob(x, self.loc, self.density_variance) + self.log_offset


def cspd_verify(draft_x0: torch.Tensor, draft_means: torch.Tensor, draft_vars: torch.Tensor,
                target_means: torch.Tensor, target_vars: torch.Tensor, generator: torch.Generator | None = None,
                density_temperature: float = 1.0, max_tries: int = 64) -> Any:
    """Verify drafted continuous tokens against the target's aligned chains (core calls only).

    Args:
        draft_x0: ``[N, C]`` drafted tokens (the draft chains' outputs).
        draft_means, draft_vars, target_means, target_vars: ``[T, N, C]`` every step's Gaussian of the
            two chains run with the same noise (variances include the sampling temperature).
        density_temperature: multiplies the standard deviation of the last-step densities (1 = CSpD's
            surrogate as specified).
    Returns:
        the core's :class:`~mmspec.continuous.ContinuousVerification` (batch shape ``[N]``): ``accepted``,
        ``samples`` (drafts where accepted, residual samples where rejected), ``num_fallbacks``; plus
        ``log_ratio`` ``[N]`` and its two terms ``log_det`` and ``last_step`` (``cspd_log_ratio_terms``)
        attached as attributes.

    The surrogate log ratio is the core's :func:`~mmspec.continuous.cspd_log_ratio` (log-determinants of
    steps 1..T-1 plus the last-step Gaussians at the draft token, tempered). The target's
    distribution object carries the log-determinant sum as a constant offset, so the core's
    ``log p(x) - log q(x)`` at the draft token is exactly that ratio, and its residual draws y from the
    target's last-step Gaussian and keeps y with probability ``max(0, 1 - 1 / r(y))``.
    """
    factor = torch.ones(draft_vars.shape[0], 1, 1, dtype=draft_vars.dtype, device=draft_vars.device)
    factor[-1] = density_temperature ** 2
    log_det, last_step = cspd_log_ratio_terms(draft_x0, target_means, target_vars * factor, draft_means,
                                              draft_vars * factor)
    target = LastStepGaussian(target_means[-1], target_vars[-1], density_temperature, log_det)
    draft = LastStepGaussian(draft_means[-1], draft_vars[-1], density_temperature)
    result = verify_continuous(draft, target, draft_x0, generator=generator, max_tries=max_tries)
    result.log_ratio, result.log_det, result.last_step = log_det + last_step, log_det, last_step
    return result


# ----------------------------------------------------------------------------------------------------
# one MAR model bound to the call's conditions
# ----------------------------------------------------------------------------------------------------


class _BoundMAR:
    """A :class:`MARModel` with the call's condition embeddings: forwards given per-row contexts, and the
    head's aligned sampling with per-token guidance."""

    def __init__(self, model: Any, condition_ids: torch.Tensor, guided: bool) -> None:
        self.model = model
        self.guided = guided
        self.cond = model.condition_embedding(condition_ids)                       # [B, P, E]
        drop = torch.ones(condition_ids.shape[0], dtype=torch.bool, device=condition_ids.device)
        self.uncond = model.condition_embedding(condition_ids, drop) if guided else None

    def token_conditions(self, rows: torch.Tensor, context: torch.Tensor, values: torch.Tensor, orders: torch.Tensor,
                         token_slot: torch.Tensor, token_grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's conditions ``z`` ``[N, D]`` of N tokens (and the unconditional ones under guidance):
        forwards for batch rows ``rows [R]``, each seeing the first ``context[r]`` tokens of its generation
        order; token n belongs to forward row ``token_slot[n]`` and sits at grid position ``token_grid[n]``.

        ``values [B, L, C]`` holds token values in order space (position i = the i-th generated token),
        ``orders [B, L]`` the grid position of each order position. The forward computes the last decoder
        block only at the tokens' positions (:meth:`MARModel.forward`'s ``positions``).
        """
        order = orders[rows]                                                          # [R, L]
        length = order.shape[1]
        seen = torch.arange(length, device=order.device)[None, :] < context[:, None]  # [R, L] order space
        visible = torch.zeros_like(seen).scatter(1, order, seen)                      # grid space
        tokens = torch.zeros_like(values[rows]).scatter(1, order[..., None].expand(-1, -1, values.shape[-1]),
                                                        values[rows])
        positions, column = _query_layout(token_slot, token_grid, rows.shape[0])
        if not self.guided:
            return self.model(tokens, visible, self.cond[rows], positions)[token_slot, column], None
        z = self.model(torch.cat([tokens, tokens]), torch.cat([visible, visible]),
                       torch.cat([self.cond[rows], self.uncond[rows]]), torch.cat([positions, positions]))
        z, z_u = z.chunk(2)
        return z[token_slot, column], z_u[token_slot, column]

    def sample(self, z: torch.Tensor, z_uncond: torch.Tensor | None, noise: torch.Tensor, guidance: torch.Tensor | None,
               temperature: float, steps: int, record: bool) -> tuple[torch.Tensor, Any, Any]:
        return self.model.sample_head(z, noise, temperature=temperature, guidance_scale=guidance,
                                      z_uncond=z_uncond if self.guided else None, num_steps=steps, record=record)


# ----------------------------------------------------------------------------------------------------
# the pipeline
# ----------------------------------------------------------------------------------------------------


class ContinuousARImagePipeline(WordVocabularyMixin, PackedCPUGemmMixin, DiffusionPipeline):
    r"""Class- or text-conditioned MAR generation over continuous tokens, target-only or with CSpD.

    Args:
        transformer: the target :class:`~mmspec.models.mar.MARModel`.
        vae: the continuous tokenizer: ``decode(latents [B, h, w, C]) -> images [B, 3, H, W]`` in [0, 1]
            and ``latent_dim == C`` (:class:`~mmspec.models.tokenizers.ContinuousTokenizer`).
        draft_transformer: a smaller MARModel of the same family (same grid, token width and condition
            layout) for ``method="cspd"``; None makes CSpD unavailable.
        text_tokenizer: word vocabulary of text-conditioned models (saved as ``transformer/text_vocab.json``).

    Example::

        >>> pipe = ContinuousARImagePipeline.from_pretrained("mmspec/shapes-t2i-continuous")
        >>> g = torch.Generator().manual_seed(0)
        >>> out = pipe(["a red circle", "two blue squares"], method="cspd", draft_length=8, generator=g)
        >>> out.images[0], out.stats.acceptance_rate
    """

    _optional_components = ["draft_transformer"]

    def __init__(self, transformer: Any, vae: Any, draft_transformer: Any = None,
                 text_tokenizer: WordTokenizer | None = None) -> None:
        super().__init__()
        config = transformer.config
        if int(vae.latent_dim) != int(config.token_dim):
            raise ValueError(f"vae latents have {vae.latent_dim} channels but the transformer's tokens have "
                             f"{config.token_dim}")
        if draft_transformer is not None:
            _check_draft(transformer, draft_transformer)
        self.register_modules(transformer=transformer, vae=vae, draft_transformer=draft_transformer)
        self._set_text_tokenizer(text_tokenizer, config.text_vocab_size if config.condition_type == "text" else None)

    # -- loading and saving ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any
                        ) -> ContinuousARImagePipeline:
        """Load a ``save_pretrained`` folder or a zoo id (``mmspec/shapes-t2i-continuous``, offline); the word
        vocabulary comes from ``transformer/text_vocab.json``. ``torch_dtype`` casts every model (default:
        float32, whatever the dtype on disk); components can be passed as objects."""
        path = Path(resolve_pretrained(pretrained_model_name_or_path))
        if not (path / "model_index.json").is_file():
            raise FileNotFoundError(f"{path} is not a saved ContinuousARImagePipeline folder (no model_index.json)")
        kwargs.setdefault("torch_dtype", torch.float32)
        return cls._from_saved_folder(path, ("transformer", "vae", "draft_transformer"), **kwargs)

    # -- inputs ---------------------------------------------------------------------------------------
    @property
    def grid_size(self) -> int:
        return int(self.transformer.config.grid_size)

    def encode_prompt(self, prompts: list[str]) -> torch.Tensor:
        """Word ids ``[B, buffer_size]``, left-padded with -1 (longer prompts keep their first words)."""
        ids = self.text_tokenizer.batch(prompts, self.transformer.config.buffer_size)
        return ids.to(self.transformer.device)

    def check_inputs(self, prompt: Any, class_labels: Any, method: str, num_iter: int, num_diffusion_steps: Any,
                     temperature: float, guidance_scale: float, cfg_schedule: str, num_images_per_prompt: int,
                     output_type: str, draft_length: int, prefill_ratio: float, verify_order: str,
                     verify_context: str, density_temperature: float, max_tries: int, generator: Any) -> None:
        config = self.transformer.config
        if method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {list(OUTPUT_TYPES)}, got {output_type!r}")
        check_condition(prompt, class_labels, config.condition_type == "text")
        if prompt is not None:
            self._check_word_prompts(as_prompt_list(prompt))
        else:
            check_class_labels(class_labels, config.num_classes)
        seq_len = config.grid_size ** 2
        if not isinstance(num_iter, int) or isinstance(num_iter, bool) or not 1 <= num_iter <= seq_len:
            raise ValueError(f"num_iter must be an integer in [1, {seq_len}] (tokens per image), got {num_iter!r}")
        if num_diffusion_steps is not None and (not isinstance(num_diffusion_steps, int)
                                                or not 1 <= num_diffusion_steps <= 1000):
            raise ValueError(f"num_diffusion_steps must be an integer in [1, 1000], got {num_diffusion_steps!r}")
        check_temperature(temperature, "temperature", MAX_NOISE_TEMPERATURE)  # scales the noise (inf: NaN)
        check_guidance_scale(guidance_scale, "guidance_scale")
        if cfg_schedule not in CFG_SCHEDULES:
            raise ValueError(f"cfg_schedule must be one of {list(CFG_SCHEDULES)}, got {cfg_schedule!r}")
        if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be a positive integer, got {num_images_per_prompt!r}")
        if not isinstance(draft_length, int) or isinstance(draft_length, bool) or draft_length < 1:
            raise ValueError(f"draft_length (gamma) must be a positive integer (draft MAR iterations per target "
                             f"pass), got {draft_length!r}")
        if not isinstance(prefill_ratio, (int, float)) or not 0.0 <= prefill_ratio < 1.0:
            raise ValueError(f"prefill_ratio must be in [0, 1) (fraction of tokens the target generates before "
                             f"drafting), got {prefill_ratio!r}")
        if verify_order not in VERIFY_ORDERS:
            raise ValueError(f"verify_order must be one of {list(VERIFY_ORDERS)}, got {verify_order!r}")
        if verify_context not in VERIFY_CONTEXTS:
            raise ValueError(f"verify_context must be one of {list(VERIFY_CONTEXTS)}, got {verify_context!r}")
        check_temperature(density_temperature, "density_temperature", DENSITY_TEMPERATURE_MAX)
        if not isinstance(max_tries, int) or max_tries < 1:
            raise ValueError(f"max_tries must be a positive integer, got {max_tries!r}")
        if method == "cspd" and self.draft_transformer is None:
            raise ValueError("method='cspd' needs a draft_transformer; this pipeline has none")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError("generator must be one torch.Generator (lists of generators are not supported)")

    # -- generation -----------------------------------------------------------------------------------
    @inference_call
    def __call__(self, prompt: str | list[str] | None = None, class_labels: int | list[int] | torch.Tensor | None = None,
                 method: str = "none", *, num_iter: int | None = None, num_diffusion_steps: int | None = None,
                 temperature: float = 1.0, guidance_scale: float = 3.0, cfg_schedule: str = "linear",
                 num_images_per_prompt: int = 1, generator: torch.Generator | None = None, output_type: str = "pil",
                 draft_length: int = 8, prefill_ratio: float = 0.05, verify_order: str = "independent",
                 verify_context: str = "round", density_temperature: float = 1.0, max_tries: int = 64,
                 callback_on_step_end: Callable[[ContinuousARImagePipeline, int, dict[str, torch.Tensor]], Any] | None = None,
                 ) -> ContinuousARImagePipelineOutput:
        """Generate images, target-only (``method="none"``) or with CSpD (``method="cspd"``).

        Args:
            prompt / class_labels: text prompt(s) (text models) or class id(s) (class models). Exactly one;
                the batch is ``len(prompts) * num_images_per_prompt`` rows (``prompt0 x n, prompt1 x n, ...``).
            num_iter: MAR iterations per image (1 .. L; L = one token per iteration; default min(32, L)).
            num_diffusion_steps: respaced DDPM steps of the head (default: the target's ``num_sampling_steps``).
            temperature: MAR's sampling temperature (scales every denoising step's noise).
            guidance_scale / cfg_schedule: classifier-free guidance and MAR's "linear" ramp (or "constant").
            generator: one ``torch.Generator`` for every random draw (orders, per-token noise, acceptance,
                residuals).
            output_type: "pil", "np", "pt" or "latent" (no decoding).
            draft_length: gamma, draft MAR iterations per target pass.
            prefill_ratio: fraction of the tokens the target generates before drafting starts (whole
                iterations, until at least ``ceil(prefill_ratio * L)`` tokens exist).
            verify_order: "independent" (official code: every drafted token verified and committed),
                "chain" (paper: stop at the first rejected token) or "iteration" (stop after the first
                MAR iteration holding a rejection, keeping all of that iteration's tokens).
            verify_context: "round" (official code: the target conditions every drafted token on the tokens
                before the round) or "exact" (each on its own iteration's context, one batched target call).
            density_temperature: multiplies the last-step standard deviations in the acceptance densities
                (1 = CSpD's surrogate; the official code uses a large "inner temperature").
            max_tries: bound on residual proposals per rejected token (then: a plain draw from the target's
                last-step Gaussian, counted in ``stats.residual_fallbacks``).
            callback_on_step_end: ``fn(pipeline, step, {"num_generated": [B]})`` after every target pass.
        Returns:
            :class:`ContinuousARImagePipelineOutput`.
        """
        if num_iter is None:
            num_iter = min(32, self.transformer.config.grid_size ** 2)
        self.check_inputs(prompt, class_labels, method, num_iter, num_diffusion_steps, temperature, guidance_scale,
                          cfg_schedule, num_images_per_prompt, output_type, draft_length, prefill_ratio,
                          verify_order, verify_context, density_temperature, max_tries, generator)
        check_callable(callback_on_step_end, "callback_on_step_end")
        model = self.transformer
        device, dtype = model.device, model.dtype
        config = model.config
        seq_len, channels = config.grid_size ** 2, config.token_dim
        steps = num_diffusion_steps or config.num_sampling_steps

        # 1. Condition rows (repeated per image) and the MAR schedule.
        if prompt is not None:
            condition = self.encode_prompt([prompt] if isinstance(prompt, str) else list(prompt))
        else:
            condition = torch.as_tensor(class_labels, dtype=torch.long, device=device).reshape(-1)
        condition = condition.repeat_interleave(num_images_per_prompt, 0)
        batch = condition.shape[0]
        schedule = mar_schedule(seq_len, num_iter)
        guided = guidance_scale != 1.0
        guidance = torch.tensor(schedule.guidance(guidance_scale, cfg_schedule, seq_len), dtype=dtype, device=device)

        # 2. Every random number that defines the image: generation orders, then each grid position's noise
        #    (x_T and one vector per noisy denoising step), shared by every chain that samples that token.
        gen_device = generator.device if generator is not None else torch.device("cpu")
        orders = torch.stack([torch.randperm(seq_len, generator=generator, device=gen_device)
                              for _ in range(batch)]).to(device)                                     # [B, L]
        noise = torch.randn(batch, seq_len, steps, channels, generator=generator, dtype=dtype,
                            device=gen_device).to(device)                                            # [B, L, T, C]

        # 3. Generate (token values in order space: values[b, i] is the i-th generated token of row b).
        state = _State(schedule=schedule, orders=orders, noise=noise, guidance=guidance if guided else None,
                       temperature=temperature, steps=steps, stats=CSpDStats(), callback=callback_on_step_end,
                       pipe=self, values=torch.zeros(batch, seq_len, channels, dtype=dtype, device=device),
                       drafted=torch.zeros(batch, seq_len, dtype=torch.bool, device=device),
                       done=torch.zeros(batch, dtype=torch.long, device=device))
        target = _BoundMAR(model, condition, guided)
        progress = self.progress_bar(total=batch * seq_len)
        state.progress = progress
        if method == "none":
            with state.stats.phase("target"):
                _target_iterations(state, target, until=seq_len)
        else:
            draft = _BoundMAR(self.draft_transformer, condition, guided)
            prefill = min(seq_len, math.ceil(prefill_ratio * seq_len))
            with state.stats.phase("prefill"):
                _target_iterations(state, target, until=prefill)
            state.stats.prefill_tokens = int(state.done.sum())
            _cspd_rounds(state, target, draft, draft_length, verify_order, verify_context, density_temperature,
                         max_tries, generator)
        progress.close()
        state.stats.tokens = batch * seq_len

        # 4. Back to grid space; decode.
        index = orders[..., None].expand(-1, -1, channels)
        grid_tokens = torch.zeros_like(state.values).scatter(1, index, state.values)
        drafted = torch.zeros_like(state.drafted).scatter(1, orders, state.drafted)
        side = config.grid_size
        latents = grid_tokens.reshape(batch, side, side, channels)
        if not bool(torch.isfinite(latents).all()):  # never hand out NaN latents (nor images made of them)
            raise NonFiniteValuesError("the generated latents contain NaN or infinite values: check the "
                                       "transformer and its diffusion head (and the draft model) for NaN or "
                                       "infinite weights")
        images: Any = None
        if output_type != "latent":
            pixels = self.vae.decode(latents.float()).float().clamp(0.0, 1.0)                        # [B, 3, H, W]
            images = images_for_output_type(pixels, output_type)
        return ContinuousARImagePipelineOutput(images=images, tokens=latents, stats=state.stats,
                                               drafted=drafted.reshape(batch, side, side))


def _check_draft(target: Any, draft: Any) -> None:
    """The draft must be a MAR of the same family: same grid, token width and condition interface."""
    t, d = target.config, draft.config
    if int(d.token_dim) != int(t.token_dim):
        raise ValueError(f"draft_transformer has token_dim={d.token_dim} but the target has {t.token_dim}: draft and "
                         "target must generate tokens of the same dimension")
    for name in ("grid_size", "condition_type", "buffer_size"):
        if getattr(d, name) != getattr(t, name):
            raise ValueError(f"draft_transformer has {name}={getattr(d, name)!r} but the target has {getattr(t, name)!r}")
    if t.condition_type == "class" and d.num_classes != t.num_classes:
        raise ValueError(f"draft_transformer has num_classes={d.num_classes} but the target has {t.num_classes}")
    if t.condition_type == "text" and d.text_vocab_size != t.text_vocab_size:
        raise ValueError(f"draft_transformer has text_vocab_size={d.text_vocab_size} but the target has "
                         f"{t.text_vocab_size}")


# ----------------------------------------------------------------------------------------------------
# the generation loops
# ----------------------------------------------------------------------------------------------------


@dataclass
class _State:
    """What the loops share: the schedule, the call's random numbers and the tokens generated so far."""

    schedule: MARSchedule
    orders: torch.Tensor          # [B, L] grid position of each order position
    noise: torch.Tensor           # [B, L, T, C] per grid position
    guidance: torch.Tensor | None  # [N_iter] guidance per iteration (None: unguided)
    temperature: float
    steps: int
    stats: CSpDStats
    callback: Any
    pipe: Any
    values: torch.Tensor          # [B, L, C] token values in order space
    drafted: torch.Tensor         # [B, L] accepted draft, order space
    done: torch.Tensor            # [B] committed tokens per row (a prefix of the order)
    progress: Any = None
    target_passes: int = 0

    def token_inputs(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Noise ``[N, T, C]`` and guidance ``[N]`` of the tokens at order ``positions`` of ``rows``."""
        grid = self.orders[rows, positions]
        guidance = None if self.guidance is None else self.guidance[self.schedule.iteration_of(positions)]
        return self.noise[rows, grid], guidance

    def after_target_pass(self, before: torch.Tensor) -> None:
        gained = self.done - before
        active = gained > 0
        self.stats.target_calls += 1
        self.stats.verify_steps += int(active.sum())
        self.stats.emitted += int(gained.sum())
        if self.progress is not None:
            self.progress.update(int(gained.sum()))
        if self.callback is not None:
            self.callback(self.pipe, self.target_passes, {"num_generated": self.done.clone()})
        self.target_passes += 1


def _target_iterations(state: _State, target: _BoundMAR, until: int) -> None:
    """Target-only MAR iterations (all rows in step) while fewer than ``until`` tokens exist."""
    starts = state.schedule.starts
    batch = state.values.shape[0]
    rows_all = torch.arange(batch, device=state.values.device)
    for s in range(state.schedule.num_iterations):
        start, end = starts[s], starts[s + 1]
        if start >= until:
            break
        rows = rows_all.repeat_interleave(end - start)
        positions = torch.arange(start, end, device=rows.device).repeat(batch)
        z, z_u = target.token_conditions(rows_all, torch.full((batch,), start, device=rows_all.device),
                                         state.values, state.orders, rows, state.orders[rows, positions])
        noise, guidance = state.token_inputs(rows, positions)
        x0, _, _ = target.sample(z, z_u, noise, guidance, state.temperature, state.steps, record=False)
        state.values[rows, positions] = x0
        before = state.done.clone()
        state.done[:] = end
        state.after_target_pass(before)


def _cspd_rounds(state: _State, target: _BoundMAR, draft: _BoundMAR, gamma: int, verify_order: str,
                 verify_context: str, density_temperature: float, max_tries: int,
                 generator: torch.Generator | None) -> None:
    """CSpD rounds until every row is complete: gamma draft iterations, one target call, core verification."""
    schedule, stats = state.schedule, state.stats
    starts = torch.tensor(schedule.starts, device=state.values.device)
    seq_len = state.values.shape[1]
    while int(state.done.min()) < seq_len:
        rows_active = (state.done < seq_len).nonzero().squeeze(1)                   # [R]
        begin = state.done[rows_active].clone()                                     # [R] first uncommitted
        # 1. Draft: gamma MAR iterations per row; iteration k covers the rest of the set holding its start.
        cursor = begin.clone()
        tokens_rows, tokens_pos, iter_k = [], [], []
        x0s, d_means, d_vars, contexts = [], [], [], []
        with stats.phase("draft"):
            for k in range(gamma):
                live = cursor < seq_len
                if not bool(live.any()):
                    break
                rows, cur = rows_active[live], cursor[live]
                it = schedule.iteration_of(cur)
                ctx, end = starts[it], starts[it + 1]                               # context, end of set
                sizes = end - cur
                r_tok = torch.repeat_interleave(torch.arange(rows.shape[0], device=rows.device), sizes)
                p_tok = torch.repeat_interleave(cur, sizes) + _ranks(sizes)        # order positions
                z, z_u = draft.token_conditions(rows, ctx, state.values, state.orders, r_tok,
                                                state.orders[rows[r_tok], p_tok])
                stats.draft_calls += 1
                noise, guidance = state.token_inputs(rows[r_tok], p_tok)
                x0, means, variances = draft.sample(z, z_u, noise, guidance, state.temperature, state.steps,
                                                    record=True)
                state.values[rows[r_tok], p_tok] = x0                               # visible to later iterations
                tokens_rows.append(rows[r_tok])
                tokens_pos.append(p_tok)
                iter_k.append(torch.full_like(p_tok, k))
                contexts.append(torch.repeat_interleave(ctx, sizes))
                x0s.append(x0)
                d_means.append(means)
                d_vars.append(variances)
                cursor[live] = end
        rows_tok, pos_tok = torch.cat(tokens_rows), torch.cat(tokens_pos)           # [N] drafted tokens
        iter_tok, ctx_tok = torch.cat(iter_k), torch.cat(contexts)                  # draft iteration, context
        slot_row = torch.searchsorted(rows_active, rows_tok)                        # active row of each token
        local = pos_tok - begin[slot_row]                                           # position within the round
        draft_x0 = torch.cat(x0s)
        draft_means, draft_vars = torch.cat(d_means, dim=1), torch.cat(d_vars, dim=1)   # [T, N, C]

        # 2. Target: one forward call scores every drafted token, its head runs their aligned chains.
        with stats.phase("target"):
            grid = state.orders[rows_tok, pos_tok]
            if verify_context == "round":
                row_ctx = starts[schedule.iteration_of(begin)]                        # context of each round's start
                z, z_u = target.token_conditions(rows_active, row_ctx, state.values, state.orders, slot_row, grid)
            else:  # one target row per (row, draft iteration), each with that iteration's context
                pair = torch.stack([rows_tok, iter_tok], 1)
                pairs, slot = torch.unique(pair, dim=0, return_inverse=True)
                pair_ctx = torch.zeros(pairs.shape[0], dtype=torch.long, device=pair.device).scatter_(0, slot, ctx_tok)
                z, z_u = target.token_conditions(pairs[:, 0], pair_ctx, state.values, state.orders, slot, grid)
            noise, guidance = state.token_inputs(rows_tok, pos_tok)
            _, target_means, target_vars = target.sample(z, z_u, noise, guidance, state.temperature, state.steps,
                                                         record=True)

        # 3. Verify in the core: surrogate ratio, acceptance in log space, residual by acceptance-rejection.
        with stats.phase("verify"):
            result = cspd_verify(draft_x0, draft_means, draft_vars, target_means, target_vars, generator,
                                 density_temperature, max_tries)
            accepted = result.accepted
            if verify_order == "chain":
                # per row, the drafted tokens in generation order: keep up to the first rejection
                width = int(local.max()) + 1
                dense = torch.ones(rows_active.shape[0], width, dtype=torch.bool, device=accepted.device)
                dense[slot_row, local] = accepted
                lead = dense.long().cumprod(1).sum(1)                                # accepted run per row
                keep = local <= lead[slot_row]                                       # run + first rejected
            elif verify_order == "iteration":
                # per row, keep the drafted iterations up to the first one with a rejection, all of its tokens
                first_rejected = torch.full((rows_active.shape[0],), gamma, dtype=torch.long,
                                            device=accepted.device)
                first_rejected.scatter_reduce_(0, slot_row[~accepted], iter_tok[~accepted], reduce="amin")
                keep = iter_tok <= first_rejected[slot_row]
            else:
                keep = torch.ones_like(accepted)
            verified = keep                                                          # chain: later ones unverified
            commit_rows, commit_pos = rows_tok[keep], pos_tok[keep]
            state.values[commit_rows, commit_pos] = result.samples[keep].to(state.values.dtype)
            state.drafted[commit_rows, commit_pos] = accepted[keep]
            before = state.done.clone()
            new_done = begin.clone()
            new_done.scatter_reduce_(0, slot_row[keep], commit_pos + 1, reduce="amax")
            state.done[rows_active] = new_done
            state.after_target_pass(before)
            stats.drafted_tokens += int(verified.sum())
            stats.accepted_tokens += int((accepted & verified).sum())
            stats.residual_fallbacks += int(result.num_fallbacks)
            _record_positions(stats, rows_tok[verified], local[verified], accepted[verified])


def _query_layout(slot: torch.Tensor, grid: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``(slot[n], grid[n])`` as forward queries: grid positions ``[num_rows, Q]`` (Q = the most
    tokens of a row; shorter rows padded with position 0) and each token's column in it."""
    counts = torch.bincount(slot, minlength=num_rows)
    by_row = torch.argsort(slot, stable=True)
    column = torch.empty_like(slot)
    column[by_row] = _ranks(counts)
    width = max(int(counts.max()) if num_rows else 0, 1)
    positions = torch.zeros(num_rows, width, dtype=torch.long, device=grid.device)
    positions[slot, column] = grid
    return positions, column


def _ranks(sizes: torch.Tensor) -> torch.Tensor:
    """``[0, 1, .., s0-1, 0, 1, .., s1-1, ...]`` for group sizes ``[s0, s1, ...]``."""
    offsets = torch.cumsum(sizes, 0) - sizes
    return torch.arange(int(sizes.sum()), device=sizes.device) - torch.repeat_interleave(offsets, sizes)


def _record_positions(stats: SpecStats, rows: torch.Tensor, local: torch.Tensor, accepted: torch.Tensor) -> None:
    """Per draft position (index within the round): verified and accepted counts."""
    if local.numel() == 0:
        return
    length = int(local.max()) + 1
    stats.grow_positions(length)
    attempts = torch.bincount(local, minlength=length).tolist()
    accepts = torch.bincount(local[accepted], minlength=length).tolist()
    for i in range(length):
        stats.position_attempts[i] += attempts[i]
        stats.position_accepts[i] += accepts[i]
