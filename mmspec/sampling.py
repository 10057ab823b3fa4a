"""Turning logits into the distributions that speculative decoding compares, and drawing from them.

Every pipeline uses these for the target *and* the drafter, so both sides see the same processed
distribution (temperature, top-k, top-p, classifier-free guidance). Verification is only lossless with
respect to the distribution it is given: what you process here is what the output follows.

Random draws use inverse-CDF sampling with uniforms taken from an optional ``torch.Generator`` so that the
torch reference and the Triton kernels (which receive the same uniforms) pick identical tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmspec.validation import check_positive_int


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution.

    Attributes:
        do_sample: False means greedy decoding (temperature 0): acceptance is an argmax match.
        temperature: softmax temperature (> 0), ignored when ``do_sample`` is False.
        top_k: keep the k most likely tokens (0 or None: no limit).
        top_p: nucleus sampling mass in (0, 1]; 1.0 disables it.
        guidance_scale: classifier-free guidance scale; 1.0 disables it. With guidance the logits come
            as a doubled batch ``[cond; uncond]`` and are merged as ``uncond + s * (cond - uncond)``.
    """

    do_sample: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    guidance_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.guidance_scale < 0:
            raise ValueError(f"guidance_scale must be >= 0, got {self.guidance_scale}")

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
    if logits.shape[0] % 2:
        raise ValueError(f"guidance expects a doubled batch [cond; uncond], got batch {logits.shape[0]}")
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + guidance_scale * (cond - uncond)


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig = SamplingConfig()) -> torch.Tensor:
    """Processed probabilities ``[..., V]`` from raw logits ``[..., V]`` (guidance already applied).

    Greedy configs return the one-hot distribution of the argmax, so greedy decoding is "sampling"
    from a point mass and the same code path serves both.
    """
    config.check_vocab(logits.shape[-1])
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if not config.do_sample:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
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


def sample_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one index per row of non-negative ``weights [..., V]`` (need not be normalised).

    Picks the smallest j with ``cumsum(w)[j] > u * sum(w)``, so zero-weight entries are never chosen.
    Rows whose weights sum to zero are the caller's bug: they get index 0 and should be avoided
    upstream (``residual`` functions fall back to the target distribution for that reason).

    Args:
        weights: ``[..., V]`` non-negative.
        uniforms: ``[...]`` in [0, 1).
    Returns:
        LongTensor ``[...]``.
    """
    cdf = weights.cumsum(-1)
    threshold = (uniforms.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf.contiguous(), threshold.contiguous(), right=True).squeeze(-1)
    return index.clamp_(max=weights.shape[-1] - 1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs [..., V]``, deterministic under ``generator``."""
    return sample_inverse_cdf(probs, draw_uniforms(probs.shape[:-1], probs, generator))


def top_k_tokens(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row and their probabilities (``[..., k]`` each)."""
    check_positive_int(k, "k")
    values, tokens = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return tokens, values
