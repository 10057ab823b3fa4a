"""Where and in what precision a command runs: ``--device`` and ``--dtype`` for ``mmspec generate``,
``mmspec demo`` and the benchmarks.

The default device is CUDA when torch sees a GPU, else the CPU, so the same command uses a GPU machine's GPU
without a flag. Asking for a device this machine lacks is a command-line error naming it, before anything
loads. Pipelines run the same code on every device: loading computes in ``--dtype`` (``torch_dtype=`` of
``from_pretrained``), then ``pipe.to(device)`` moves every component.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from mmspec.validation import COMMAND_LINE_DTYPES, dtype_argument


def default_device() -> str:
    """``"cuda"`` when torch sees a GPU, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | torch.device, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` this machine has; ``ValueError`` naming ``name`` otherwise."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{name} must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}: "
                         f"{error}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={str(device)!r}, but torch sees no CUDA GPU on this machine (torch "
                             f"{torch.__version__}); use 'cpu'")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={str(device)!r}, but this machine has {torch.cuda.device_count()} CUDA "
                             "device(s)")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{name}={str(device)!r}, but MPS is not available on this machine; use 'cpu'")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{name} must be 'cpu', 'cuda' (or 'cuda:N') or 'mps', got {str(device)!r}")
    return parsed


def device_argument(text: str) -> torch.device:
    """argparse ``type=`` of ``--device``."""
    try:
        return check_device(text, "--device")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_device_arguments(parser: argparse.ArgumentParser, dtype_help: str | None = None) -> None:
    """``--device`` (default :func:`default_device`) and ``--dtype`` (default float32)."""
    parser.add_argument("--device", type=device_argument, default=None,
                        help="where to run: cpu, cuda, cuda:N or mps (default: cuda when torch sees a GPU, else cpu)")
    parser.add_argument("--dtype", type=dtype_argument, default=torch.float32,
                        help=dtype_help or f"compute precision, one of {', '.join(COMMAND_LINE_DTYPES)} (default "
                                           "float32; the baseline runs in the same precision)")


def resolved_device(args: argparse.Namespace) -> torch.device:
    """``args.device``, or the machine's default when the flag was not given."""
    return args.device if getattr(args, "device", None) is not None else torch.device(default_device())


def load_pipeline(pipeline_class: type, path: Any, *, device: str | torch.device | None = None,
                  dtype: torch.dtype | None = None, **kwargs: Any) -> Any:
    """``pipeline_class.from_pretrained(path, torch_dtype=dtype, **kwargs).to(device)`` (None: the pipeline's
    own precision; the machine's default device)."""
    target = check_device(device if device is not None else default_device())
    if dtype is not None:
        kwargs["torch_dtype"] = dtype
    pipe = pipeline_class.from_pretrained(path, **kwargs)
    return pipe.to(target)
