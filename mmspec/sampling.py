"""Turning logits into the distributions that speculative decoding compares, and drawing from them.

Every pipeline uses these for the target *and* the drafter, so both sides see the same processed
distribution (temperature, top-k, top-p, classifier-free guidance). Verification is only lossless with
respect to the distribution it is given: what you process here is what the output follows.

Random draws use inverse-CDF sampling with uniforms taken from an optional ``torch.Generator`` so that the
torch reference and the Triton kernels (which receive the same uniforms) pick identical tokens.

Every draw (:func:`sample_inverse_cdf`, :func:`greedy_tokens`, :func:`draw`) refuses rows that no token can
come from, NaN, infinite or all-zero ones, with a :class:`~mmspec.validation.NonFiniteProbabilitiesError`
naming the step (``name``) and the row: a NaN weight in a model, or logits overflowed by a near-zero
temperature or a huge guidance scale, would otherwise become token 0 or the last token without a word. The
check reads one number per draw (see :func:`~mmspec.validation.check_row_scales`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral

import torch

from mmspec.validation import (
    check_bool,
    check_finite_rows,
    check_guidance_scale,
    check_positive_int,
    check_probability_rows,
    check_row_scales,
    check_temperature,
    checks_enabled,
    is_number,
)


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution.

    Attributes:
        do_sample: False means greedy decoding (temperature 0): acceptance is an argmax match.
        temperature: softmax temperature, finite and >= :data:`~mmspec.validation.MIN_TEMPERATURE` (0.01;
            near-zero ones such as 1e-45 overflow float32 logits); ignored when ``do_sample`` is False (it
            must still not be NaN or infinite).
        top_k: keep the k most likely tokens (0 or None: no limit).
        top_p: nucleus sampling mass in (0, 1]; 1.0 disables it.
        guidance_scale: classifier-free guidance scale in [0, :data:`~mmspec.validation.MAX_GUIDANCE_SCALE`];
            1.0 disables it. With guidance the logits come as a doubled batch ``[cond; uncond]`` and are
            merged as ``uncond + s * (cond - uncond)``.
    """

    do_sample: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    guidance_scale: float = 1.0

    def __post_init__(self) -> None:
        check_bool(self.do_sample, "do_sample")
        if self.do_sample:
            check_temperature(self.temperature, "temperature", hint=" when sampling (near 0 the scaled "
                              "logits overflow float32; for greedy decoding pass do_sample=False)")
        elif is_number(self.temperature) and not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, Integral) or isinstance(self.top_k, bool)
                                       or self.top_k < 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 or None disables it), got {self.top_k!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        check_guidance_scale(self.guidance_scale, "guidance_scale")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if ``top_k`` cannot apply to a vocabulary of ``vocab_size`` tokens."""
        if self.top_k and self.top_k > vocab_size:
            raise ValueError(f"top_k={self.top_k} is larger than the vocabulary ({vocab_size} tokens)")


def apply_guidance(logits: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance over a doubled batch.

    Args:
        logits: ``[2B, ..., V]``, the conditional rows first, then the unconditional rows.
    Returns:
        ``[B, ..., V]`` guided logits ``uncond + s * (cond - uncond)``.
    """
    if not isinstance(guidance_scale, torch.Tensor):  # per-token scale tensors are the caller's to check
        check_guidance_scale(guidance_scale, "guidance_scale")
    if logits.shape[0] % 2:
        raise ValueError(f"guidance expects a doubled batch [cond; uncond], got batch {logits.shape[0]}")
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + guidance_scale * (cond - uncond)


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig = SamplingConfig(),
                    name: str = "logits") -> torch.Tensor:
    """Processed probabilities ``[..., V]`` from raw logits ``[..., V]`` (guidance already applied).

    Greedy configs return the one-hot distribution of the argmax, so greedy decoding is "sampling"
    from a point mass and the same code path serves both; a row with a NaN or infinite logit raises there
    (``name`` says whose logits), since its argmax would be the NaN's index. Sampled rows with one come out
    NaN (softmax normalises by a NaN sum), which the draws refuse.
    """
    config.check_vocab(logits.shape[-1])
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if not config.do_sample:
        best, tokens = top_token(logits)  # NaN where the row holds one
        check_finite_rows(best, logits, name)
        return torch.zeros_like(logits).scatter_(-1, tokens.unsqueeze(-1), 1.0)
    if config.temperature != 1.0:  # (dividing by 1 changes nothing and costs an operation per call)
        logits = logits / config.temperature
    if config.top_k:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def draw_uniforms(shape: tuple[int, ...], like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Uniforms in [0, 1) with the dtype and device of ``like``, from ``generator`` when given."""
    device = generator.device if generator is not None else like.device
    u = torch.rand(shape, generator=generator, dtype=torch.float64, device=device)
    u = u.to(device=like.device, dtype=like.dtype)
    # a float64 draw just below 1 can round up to 1.0 in float32/bfloat16, which would make the
    # inverse-CDF search fall through to the last (possibly zero-weight) token
    return u.clamp_(max=1.0 - torch.finfo(like.dtype).eps)


def sample_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor, name: str = "weights") -> torch.Tensor:
    """Draw one index per row of non-negative ``weights [..., V]`` (need not be normalised).

    Picks the smallest j with ``cumsum(w)[j] > u * sum(w)``, so zero-weight entries are never chosen. A row
    whose total is not a positive finite number (NaN or infinite entries, or all zero) raises
    :class:`~mmspec.validation.NonFiniteProbabilitiesError` naming ``name`` and the row: it has no token to
    give. (``residual`` functions fall back to the target distribution where a residual has no mass.)
    Negative entries are the callers' to refuse (:func:`sample` and the verification entry points do).

    Args:
        weights: ``[..., V]`` non-negative.
        uniforms: ``[...]`` in [0, 1).
        name: the step the rows belong to, for the error ("target distribution", "residual", ...).
    Returns:
        LongTensor ``[...]``.
    """
    cdf = weights.cumsum(-1)
    total = cdf[..., -1]
    check_row_scales(total, weights, name)
    threshold = (uniforms.to(cdf.dtype) * total).unsqueeze(-1)
    index = torch.searchsorted(cdf.contiguous(), threshold.contiguous(), right=True).squeeze(-1)
    return index.clamp_(max=weights.shape[-1] - 1)


def top_token(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value, index)`` of the first maximum of each row of ``weights [..., V]`` (NaN counts as the
    maximum, as in ``argmax``). An argmax and a gather: ``max(dim)`` opens a parallel region on small CPU
    tensors, which took milliseconds instead of microseconds on a busy machine; long CPU rows take
    :func:`first_argmax`'s two vectorised reductions."""
    tokens = first_argmax(weights)
    return weights.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), tokens


#: Rows at least this long are reduced chunk by chunk on the CPU (:func:`first_argmax`).
CHUNKED_ARGMAX_MIN = 8192
_ARGMAX_CHUNK = 256


def first_argmax(weights: torch.Tensor) -> torch.Tensor:
    """``weights.argmax(-1)``: the index of each row's first maximum, NaN counting as the maximum.

    torch's CPU ``argmax`` over a long row runs a scalar loop (about 10 ms for 20 rows of Qwen2-VL's 151,936
    logits on one core, more than their softmax); ``amax`` is vectorised. Long floating-point rows on the
    CPU therefore take the maximum of each chunk of 256 entries, the first chunk holding the row's maximum
    (argmax over the chunk maxima) and the first maximum inside it: the same index, about 4x faster.
    """
    vocab = weights.shape[-1]
    if weights.device.type != "cpu" or vocab < CHUNKED_ARGMAX_MIN or not weights.is_floating_point():
        return weights.argmax(-1)
    chunk = _ARGMAX_CHUNK
    whole = vocab - vocab % chunk
    maxima = weights[..., :whole].unflatten(-1, (whole // chunk, chunk)).amax(-1)
    if whole < vocab:  # the shorter last chunk
        maxima = torch.cat([maxima, weights[..., whole:].amax(-1, keepdim=True)], -1)
    start = maxima.argmax(-1, keepdim=True) * chunk  # NaN chunks count as the maximum, as argmax's NaN does
    # The chunk's entries; indices past the row's end repeat its last entry, after it, so never first.
    span = (start + torch.arange(chunk, device=weights.device)).clamp_(max=vocab - 1)
    return (start + weights.gather(-1, span).argmax(-1, keepdim=True)).squeeze(-1)


def greedy_tokens(weights: torch.Tensor, name: str = "weights") -> torch.Tensor:
    """The most likely index of each row of non-negative ``weights [..., V]`` (the first on ties, as argmax).

    A row whose maximum is not a positive finite number (NaN, infinite or all zero) raises as in
    :func:`sample_inverse_cdf`: the argmax of a NaN row is the NaN's index, a valid-looking token.
    """
    best, tokens = top_token(weights)
    check_row_scales(best, weights, name)
    return tokens


def draw(weights: torch.Tensor, greedy: bool, *, generator: torch.Generator | None = None,
         uniforms: torch.Tensor | None = None, name: str = "weights") -> torch.Tensor:
    """One index per row of ``weights [..., V]``: :func:`greedy_tokens` when ``greedy``, else an inverse-CDF
    draw with ``uniforms [...]`` (drawn from ``generator`` when None; greedy draws consume none)."""
    if greedy:
        return greedy_tokens(weights, name)
    if uniforms is None:
        uniforms = draw_uniforms(weights.shape[:-1], weights, generator)
    return sample_inverse_cdf(weights, uniforms, name)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None,
           name: str = "probs") -> torch.Tensor:
    """One token per row of ``probs [..., V]``, deterministic under ``generator``.

    Raises :class:`~mmspec.validation.NonFiniteProbabilitiesError` naming ``name`` and the first row that is
    NaN or infinite, all zero, or (while value checks are on) has a negative entry.
    """
    if checks_enabled() and probs.numel() and float(probs.detach().amin()) < 0:  # NaN rows: left to the draw
        check_probability_rows(probs, name)
    return sample_inverse_cdf(probs, draw_uniforms(probs.shape[:-1], probs, generator), name)


def coupled_redraw(previous_tokens: torch.Tensor, previous_probs: torch.Tensor, probs: torch.Tensor,
                   generator: torch.Generator | None = None, name: str = "probs") -> torch.Tensor:
    """A draw from ``probs [..., V]`` maximally coupled with ``previous_tokens [...]``, which were drawn from
    ``previous_probs [..., V]``: each previous token is kept with probability min(1, p(x) / q(x)), otherwise a
    token is drawn from the residual norm(max(0, p - q)).

    The result is distributed exactly as ``probs`` (the speculative-sampling identity), and it equals the
    previous token with the largest probability any coupling allows, 1 - TV(p, q). Speculative coupled
    Jacobi decoding redraws its window this way, so slots stop flickering between iterations.
    """
    kept_mass = probs.gather(-1, previous_tokens.unsqueeze(-1)).squeeze(-1)
    proposed_mass = previous_probs.gather(-1, previous_tokens.unsqueeze(-1)).squeeze(-1)
    keep_u = draw_uniforms(previous_tokens.shape, probs, generator)
    keep = keep_u * proposed_mass < kept_mass  # u < p/q without dividing by a zero q
    residual = (probs - previous_probs).clamp_min(0)
    empty = residual.sum(-1) <= 0  # p == q: every previous token is kept anyway
    residual = torch.where(empty.unsqueeze(-1), probs, residual)
    fresh = sample_inverse_cdf(residual, draw_uniforms(previous_tokens.shape, probs, generator), name)
    return torch.where(keep, previous_tokens, fresh)


def top_k_tokens(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row and their probabilities (``[..., k]`` each)."""
    check_positive_int(k, "k")
    values, tokens = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return tokens, values


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator | None = None,
                               exclude: torch.Tensor | None = None, name: str = "probs") -> torch.Tensor:
    """``k`` distinct tokens per row of ``probs [..., V]``, drawn one after another, each from ``probs`` with
    the tokens drawn before it (and ``exclude [..., m]``, tokens drawn earlier from the same law) removed:
    successive sampling without replacement, the law :func:`~mmspec.tree.verify_tree` assumes for siblings of
    a tree with ``without_replacement=True``. Returns LongTensor ``[..., k]``.

    A row whose support is exhausted (fewer tokens with mass than it needs) repeats its first remaining token
    from then on: verification skips a sibling equal to an earlier one, which is exact (a tree with fewer
    siblings). One uniform per draw, from ``generator``.
    """
    check_positive_int(k, "k")
    remaining = probs.clone()
    if exclude is not None:
        remaining.scatter_(-1, exclude, 0.0)
    drawn = []
    for _ in range(k):
        empty = remaining.sum(-1, keepdim=True) <= 0
        weights = torch.where(empty, probs, remaining)
        token = sample_inverse_cdf(weights, draw_uniforms(weights.shape[:-1], weights, generator), name)
        if exclude is not None:  # an exhausted row repeats an excluded (earlier) token, never a new one
            token = torch.where(empty.squeeze(-1), exclude[..., 0], token)
        drawn.append(token)
        remaining.scatter_(-1, token.unsqueeze(-1), 0.0)
    return torch.stack(drawn, -1)
