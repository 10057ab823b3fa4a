"""A correction to vLLM 0.32's CPU build that sampled speculative decoding needs (applied by the plugin).

vLLM's rejection sampler scales the target's logits at the drafted positions by each request's temperature,
expanded from one value per request to one per drafted token by ``expand_batch_to_tokens``
(vllm/v1/sample/rejection_sampler.py). On the CPU build that expansion runs ``_expand_kernel_impl``
(vllm/utils/cpu_triton_utils.py), which converts its output tensor to int64 before the C++ kernel writes
into it: for a float output (temperatures, top-p) the kernel fills a temporary copy and the real output
keeps whatever ``new_empty`` left in it. The drafted positions are then divided by garbage temperatures
(NaN, inf or arbitrary values), so sampled requests with speculation, vLLM's own ``draft_model`` included,
draw from wrong distributions; greedy requests skip the scaling and stay exact.

:func:`apply` replaces that function with :func:`expand_per_token`, a torch version with the Triton kernel's
semantics, in vLLM's CPU worker processes (the plugin's ``register`` runs before the platform installs
its kernel overrides, which read the function by name), and only where a probe shows the bug: a vLLM whose
function works is left alone. Set ``MMSPEC_VLLM_CPU_FIXES=0`` to keep vLLM's function.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENVIRONMENT_SWITCH = "MMSPEC_VLLM_CPU_FIXES"
MODULE = "vllm.utils.cpu_triton_utils"
FUNCTION = "_expand_kernel_impl"


def expand_per_token(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                     replace_from: Any, replace_to: Any, MAX_NUM_TOKENS: int | None = None) -> None:  # noqa: N803
    """``output[start_i:end_i] = input_val[i]`` for each request i (its tokens end at ``cu_num_tokens[i]``),
    with values equal to ``replace_from`` written as ``replace_to``: vLLM's ``expand_kernel``, in place, for
    any dtype. ``MAX_NUM_TOKENS`` is the Triton kernel's block size, accepted for the call convention."""
    ends = cu_num_tokens.to(torch.long)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = values.repeat_interleave(counts)
    output[:expanded.numel()] = expanded.to(output.dtype)


def expansion_is_broken(function: Any) -> bool:
    """Whether ``function`` (vLLM's CPU expansion) leaves a float output unwritten."""
    output = torch.full((3,), -1.0)
    function(output, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 0, 1)
    return output.tolist() != [0.5, 2.0, 2.0]


def apply() -> bool:
    """Install :func:`expand_per_token` in place of vLLM's CPU expansion where that one is broken; returns
    whether it did. Does nothing off the CPU platform, with ``MMSPEC_VLLM_CPU_FIXES=0``, or when vLLM has no
    such function or its function works."""
    if os.environ.get(ENVIRONMENT_SWITCH, "1") == "0":
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        return False
    original = getattr(module, FUNCTION, None)
    if original is None or original is expand_per_token:
        return False
    current_platform.import_kernels()  # the C++ kernels the probe calls (idempotent)
    try:
        broken = expansion_is_broken(original)
    except Exception as error:  # noqa: BLE001 - a vLLM whose kernel cannot even be probed is left as it is
        logger.warning("mmspec: could not probe vLLM's CPU %s (%s); left unchanged", FUNCTION, error)
        return False
    if not broken:
        return False
    setattr(module, FUNCTION, expand_per_token)
    logger.info("mmspec: replaced vLLM's CPU %s.%s, which drops float outputs (sampled speculative decoding "
                "would scale drafted positions by uninitialised temperatures)", MODULE, FUNCTION)
    return True
