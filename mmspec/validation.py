"""Input checks shared by the core: clear ``ValueError``s that name the argument at fault.

Verification sits in every decoding loop, so the checks are cheap (shape/dtype logic plus a few
reductions) and can be switched off for hot loops that already validated their inputs once
(``MMSPEC_CHECKS=0`` or :func:`checks_enabled`).

Probability rows that no token can be drawn from (NaN or infinite entries, negative entries, all zero) raise
:class:`NonFiniteProbabilitiesError`. The full per-row scan (:func:`check_probability_rows`) is one of the
switchable value checks; the draws themselves (``mmspec.sampling``) always check each row's total or maximum
(:func:`check_row_scales`, one host read), so a NaN from a model is refused inside the decoding loops too.
"""

from __future__ import annotations

import argparse
import math
import os
import threading
from numbers import Real

import torch

_DEFAULT_CHECKS = os.environ.get("MMSPEC_CHECKS", "1") != "0"
_switch = threading.local()  # per thread: a decoding loop that switches the checks off affects only its own thread


def checks_enabled() -> bool:
    """Whether the (cheap but not free) value checks on probability tensors run in this thread."""
    return getattr(_switch, "enabled", _DEFAULT_CHECKS)


class value_checks:  # noqa: N801 (used as a function: ``with value_checks(False):``)
    """Temporarily switch the probability value checks on or off in the calling thread (shape checks and the
    draws' row checks always run). A class rather than a generator: verification enters it on every call.
    Per thread, so that two threads decoding at once cannot leave the checks switched off for everyone."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.previous = enabled, _DEFAULT_CHECKS

    def __enter__(self) -> None:
        self.previous = getattr(_switch, "enabled", _DEFAULT_CHECKS)
        _switch.enabled = self.enabled

    def __exit__(self, *exc_info: object) -> None:
        _switch.enabled = self.previous


def check_positive_int(value: int, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


#: The most outputs one pipeline call makes per prompt (``num_images_per_prompt``, ``num_videos_per_prompt``):
#: every output is a row of one batched loop, so a count far beyond what fits in memory (10**6 images ask for
#: terabytes) would fail with an out-of-memory error deep inside torch. Distribution checks of small models
#: draw a few thousand rows of one prompt in one call; more outputs take more calls.
MAX_OUTPUTS_PER_PROMPT = 4096


def check_count(value: int, name: str, maximum: int) -> None:
    """``value`` is an integer (not a bool) in ``[1, maximum]``; the error names ``name`` and the bound."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ValueError(f"{name} must be an integer in [1, {maximum}], got {value!r}")


#: The largest draft tree a :class:`~mmspec.drafters.TreeConfig` may ask for: branches per node and nodes
#: verified per round. Published trees stay far below (EAGLE-2: top_k 10, 60 nodes); every node is a row of the
#: target's verification pass and of the tree attention mask, so a tree of thousands of nodes makes each round
#: slower than decoding without drafts (4,096 nodes took 30 s for 16 tokens), and a top_k past the vocabulary
#: fails inside ``torch.topk``. The depth needs no bound of its own: a tree is never deeper than its nodes nor
#: than what is left to generate.
TREE_LIMITS = {"top_k": 64, "total_tokens": 512}


def max_position_embeddings(model: object) -> int | None:
    """``max_position_embeddings`` of a transformers (V)LM's language model or of a draft head's config (None
    when it declares none)."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    value = config.get("max_position_embeddings") if isinstance(config, dict) else \
        getattr(config, "max_position_embeddings", None)
    return int(value) if value is not None else None


def check_position_limits(prompt_positions: int, max_new_tokens: int, limits: dict[str, int]) -> None:
    """Refuse a generation whose prompt (``prompt_positions``, image and video tokens included) plus
    ``max_new_tokens`` exceeds a model's ``max_position_embeddings`` (``limits``: model name -> limit, e.g.
    ``{"target": 2048, "flash_head": 512}``): past it a model runs without error on positions it never learnt
    and answers nonsense.

    Raises:
        ValueError: naming the prompt's positions, ``max_new_tokens``, the model and its limit.
    """
    for name, limit in limits.items():
        if prompt_positions + max_new_tokens <= limit:
            continue
        model = "the target's" if name == "target" else f"the {name}'s"
        if prompt_positions >= limit:
            raise ValueError(f"the prompt takes {prompt_positions} positions (image and video tokens included), but "
                             f"{model} max_position_embeddings is {limit}: shorten the prompt or use fewer images "
                             "or video frames")
        raise ValueError(f"the prompt takes {prompt_positions} positions (image and video tokens included) and "
                         f"max_new_tokens={max_new_tokens} more, but {model} max_position_embeddings is {limit}: "
                         f"lower max_new_tokens to at most {limit - prompt_positions}, shorten the prompt or use "
                         "fewer images or video frames")


def check_bool(value: object, name: str) -> None:
    """``value`` is a bool (``do_sample="yes"`` or ``1`` would otherwise be read by truthiness)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def positive_int_argument(text: str) -> int:
    """argparse ``type=`` of a count >= 1 (command-line options such as ``--quality-seeds``)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


#: Compute precisions a command line may ask for (``--dtype``): the checkpoints' float32, and bfloat16, the
#: precision such models are deployed in, which CPUs with bfloat16 instructions multiply fastest.
COMMAND_LINE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_argument(text: str) -> torch.dtype:
    """argparse ``type=`` of ``--dtype``: a name in :data:`COMMAND_LINE_DTYPES`."""
    if text not in COMMAND_LINE_DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(COMMAND_LINE_DTYPES)}, got {text!r}")
    return COMMAND_LINE_DTYPES[text]


def check_callable(value: object, name: str) -> None:
    """``value`` is None or callable (a pipeline's ``callback_on_step_end``), checked before any work."""
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be callable or None, got {type(value).__name__}")


#: Smallest sampling temperature accepted. Below it sampling is nearly greedy (``do_sample=False`` decodes
#: greedily), and dividing float32 logits by a subnormal temperature such as 1e-45 turns them into
#: infinities, whose softmax is NaN. Logits up to 3e36 in magnitude stay finite divided by 1e-2.
MIN_TEMPERATURE = 1e-2
#: Largest noise temperature of continuous (diffusion-head) sampling: it multiplies every step's standard
#: deviation, so variances grow with its square (1e4 at most); MAR samples near 1.
MAX_NOISE_TEMPERATURE = 1e2
#: Largest classifier-free guidance scale accepted. Published scales stay below 50; at 1e3 guided logits
#: ``uncond + s (cond - uncond)`` are at most about 2e3 times the raw ones (finite in float32, also divided
#: by :data:`MIN_TEMPERATURE`), while ``inf`` or 1e300 make them infinite and every distribution NaN.
MAX_GUIDANCE_SCALE = 1e3


def is_number(value: object) -> bool:
    """A real number (Python or NumPy), not a boolean, a string or a tensor."""
    return isinstance(value, Real) and not isinstance(value, bool)


def check_guidance_scale(value: float, name: str) -> None:
    """``value`` is a classifier-free guidance scale: a real number in [0, :data:`MAX_GUIDANCE_SCALE`]
    (NaN, inf, booleans and strings rejected)."""
    if not is_number(value) or not 0 <= value <= MAX_GUIDANCE_SCALE:
        raise ValueError(f"{name} must be a number in [0, {MAX_GUIDANCE_SCALE:g}] (a finite classifier-free "
                         f"guidance scale; larger scales overflow the guided logits), got {value!r}")


def check_temperature(value: float, name: str, maximum: float = math.inf, hint: str = "") -> None:
    """``value`` is a sampling temperature: a finite real number in [:data:`MIN_TEMPERATURE`, ``maximum``]
    (NaN, inf, booleans and strings rejected); ``hint`` ends the error message."""
    if not is_number(value) or not MIN_TEMPERATURE <= value <= maximum or not math.isfinite(value):
        upper = f"{maximum:g}]" if math.isfinite(maximum) else "inf)"
        raise ValueError(f"{name} must be a finite number in [{MIN_TEMPERATURE:g}, {upper}, "
                         f"got {value!r}{hint}")


def guidance_scale_argument(text: str) -> float:
    """argparse ``type=`` of a guidance scale (``--guidance-scale``): checked before any work."""
    value = float(text)
    try:
        check_guidance_scale(value, "the guidance scale")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def check_unit_interval(value: float, name: str) -> None:
    """``value`` is a real number in [0, 1) (NaN and booleans rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")


def check_ndim(tensor: torch.Tensor, ndim: int, name: str, layout: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(tensor).__name__}")
    if tensor.ndim != ndim:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(tensor.shape)}")


class NonFiniteValuesError(ValueError):
    """Values that must be finite are NaN or infinite (a latent, a density, a sample)."""


#: What a bad probability row usually means, and what to check.
_BAD_ROW_ADVICE = ("no token can be drawn from it. Check the model for NaN or infinite weights or "
                   f"activations (an LM head, a drafter), that temperature >= {MIN_TEMPERATURE:g} and "
                   f"guidance_scale <= {MAX_GUIDANCE_SCALE:g}, and that probabilities (not logits) "
                   "were given")


class NonFiniteProbabilitiesError(NonFiniteValuesError):
    """A probability row is NaN or infinite, negative or all zero, so no token can be drawn from it.

    Attributes:
        name: the step or argument the row belongs to ("target distribution", "draft distribution",
            "residual", "probs", ...).
        row: index of the first bad row (the leading indices of the ``[..., V]`` tensor).
        problem: what is wrong with that row.
    """

    def __init__(self, name: str, row: tuple[int, ...], problem: str) -> None:
        self.name, self.row, self.problem = name, row, problem
        super().__init__(f"{name}: row {list(row)} {problem}; {_BAD_ROW_ADVICE}")

    def __reduce__(self) -> tuple:  # picklable across processes despite the custom signature
        return type(self), (self.name, self.row, self.problem)


def describe_bad_row(row: torch.Tensor) -> str:
    """What makes the probability row ``row [V]`` unusable, in words ("" when nothing does)."""
    if bool(torch.isnan(row).any()):
        return "contains NaN"
    if bool(torch.isinf(row).any()):
        return "contains an infinite value"
    if bool((row < 0).any()):
        return f"contains negative probabilities (min {float(row.min()):.4g})"
    total = float(row.sum(dtype=torch.float64))
    if total == 0:
        return "is all zero"
    if not math.isfinite(total):
        return "sums to infinity"
    return ""


def _bad_row_error(rows: torch.Tensor, bad: torch.Tensor, name: str) -> NonFiniteProbabilitiesError:
    """The error for the first True entry of ``bad [...]`` (one per row of ``rows [..., V]``)."""
    index = tuple(int(i) for i in bad.nonzero()[0])
    problem = describe_bad_row(rows[index]) or "has a total or maximum that is not a positive finite number"
    return NonFiniteProbabilitiesError(name, index, problem)


def probability_row_error(probs: torch.Tensor, name: str) -> NonFiniteProbabilitiesError | None:
    """The error for the first row of ``probs [..., V]`` that is not finite, has a negative entry or is all
    zero, or None: a full scan (three reductions), for entry points and error paths."""
    if probs.numel() == 0:
        return None
    sums = probs.sum(-1)  # NaN or inf anywhere makes the row's sum non-finite
    good = torch.isfinite(sums) & (sums > 0) & (probs.amin(-1) >= 0)
    return None if bool(good.all()) else _bad_row_error(probs, ~good, name)


def check_probability_rows(probs: torch.Tensor, name: str) -> None:
    """Raise :class:`NonFiniteProbabilitiesError` naming ``name`` and the first bad row of ``probs [..., V]``
    (see :func:`probability_row_error`)."""
    error = probability_row_error(probs, name)
    if error is not None:
        raise error


#: Up to this many values, :func:`positive_and_finite` reads them all and compares them on the host.
_HOST_COMPARE_LIMIT = 64


def positive_and_finite(scales: torch.Tensor) -> bool:
    """Whether every entry of ``scales`` lies in (0, inf), in one host read. A few values (one per row of a
    draw: the usual case) are read and compared on the host, with no tensor operation (NaN compares False);
    more are reduced first: the sum of the logs is finite exactly when each lies in (0, inf) (log 0 = -inf,
    log inf = inf, and the log of NaN or of a negative number is NaN)."""
    if scales.requires_grad:  # (a scalar read of a graph tensor warns)
        scales = scales.detach()
    if scales.numel() <= _HOST_COMPARE_LIMIT:
        values = scales.tolist()  # (flattening first would copy: row totals are often a strided view)
        for _ in range(scales.ndim - 1):
            values = [value for row in values for value in row]
        return all(0.0 < value < math.inf for value in (values if scales.ndim else [values]))
    return math.isfinite(float(scales.log().sum(dtype=torch.float32)))


def check_row_scales(scales: torch.Tensor, rows: torch.Tensor, name: str) -> None:
    """Raise :class:`NonFiniteProbabilitiesError` unless each entry of ``scales [...]`` (a total or the
    maximum of the matching row of ``rows [..., V]``) is a positive finite number.

    Every draw runs this check, so it costs what :func:`positive_and_finite` costs (one host read); the bad
    row is located only after a failure.
    """
    if not positive_and_finite(scales):
        raise _bad_row_error(rows, ~((scales > 0) & (scales < math.inf)), name)


def check_finite_rows(values: torch.Tensor, rows: torch.Tensor, name: str) -> None:
    """Raise :class:`NonFiniteProbabilitiesError` unless each entry of ``values [...]`` (the maximum logit of
    the matching row of ``rows [..., V]``) is finite: a NaN anywhere in a row makes its maximum NaN."""
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        raise _bad_row_error(rows, ~finite, name)


def blame_inputs(error: NonFiniteProbabilitiesError, *inputs: tuple[str, torch.Tensor | None]
                 ) -> NonFiniteProbabilitiesError:
    """The error to report when a row derived from ``inputs`` (a residual) was refused: the first bad row of
    the first named input that has one (the distribution a model produced), else ``error`` itself. Runs only
    after a failure, so it may scan everything."""
    for name, probs in inputs:
        found = None if probs is None else probability_row_error(probs, name)
        if found is not None:
            return found
    return error


def check_finite(values: torch.Tensor, name: str, advice: str) -> None:
    """Raise :class:`NonFiniteValuesError` naming ``name`` and the first NaN or infinite entry of ``values``
    (``advice``: what to check)."""
    finite = torch.isfinite(values)
    if bool(finite.all()):
        return
    index = [int(i) for i in (~finite).nonzero()[0]]
    raise NonFiniteValuesError(f"{name} contains NaN or infinite values (first at index {index}): {advice}")


def check_probs(probs: torch.Tensor, name: str, atol: float = 1e-3) -> None:
    """Probabilities must be floating, finite, non-negative, not all zero and sum to 1 over the last dim.

    The value part is switchable (:func:`value_checks`); the draws still refuse NaN, infinite and all-zero
    rows when it is off (:func:`check_row_scales`)."""
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor of probabilities, got {probs.dtype}")
    if not checks_enabled() or probs.numel() == 0:
        return
    sums = probs.sum(-1)  # one pass: NaN/inf anywhere makes its row sum non-finite
    good = torch.isfinite(sums) & (sums > 0) & (probs.amin(-1) >= 0)
    if not bool(good.all()):
        raise _bad_row_error(probs, ~good, name)
    worst = (sums - 1).abs().max().item()
    if worst > atol:
        raise ValueError(f"{name} is not normalised over the vocabulary (a row sums to {1 + worst:.4g} or "
                         f"{1 - worst:.4g}); pass probabilities, not logits")


def check_token_ids(tokens: torch.Tensor, vocab_size: int, name: str) -> None:
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an integer tensor of token ids, got {tokens.dtype}")
    if not tokens.numel():
        return
    low, high = (int(value) for value in torch.aminmax(tokens))  # one pass, read on the host at once
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} has token ids outside [0, {vocab_size}) (min {low}, max {high})")
