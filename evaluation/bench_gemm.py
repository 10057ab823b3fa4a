"""Microseconds per fp32 linear call, PyTorch's default ``F.linear`` against the packed oneDNN kernel of
:mod:`mmspec.cpu_gemm`, by rows and layer shape: the measurement behind ``DEFAULT_MIN_MACS`` and behind
``--cpu-gemm packed`` in the benchmarks.

    python -m mmspec.evaluation.bench_gemm [--threads 1 2] [--rows 1 2 4 8 16 26 64] [--out table.md]

Each cell is ``F.linear / packed`` (median of ``--repeats`` timings of ``--calls`` calls). The default
shapes are the shapes zoo's (192 -> 512, 512 -> 192, the 192 -> 2048 LM head, the EAGLE block head's
768 -> 768) and one of a 7B model's (4096 -> 4096).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from mmspec.cpu_gemm import (
    DEFAULT_MIN_MACS,
    onednn_linear,
    onednn_linear_available,
    pack_weight,
)

from .bench_cli import command_line, new_parser
from .files import write_text_atomic

DEFAULT_SHAPES = ("192x512", "512x192", "192x2048", "768x768", "4096x4096")


def time_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median microseconds per call of ``fn`` over ``repeats`` timings of ``calls`` calls (after a warm-up)."""
    for _ in range(max(calls // 10, 3)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append(1e6 * (time.perf_counter() - start) / calls)
    return statistics.median(samples)


def parse_shape(text: str) -> tuple[int, int]:
    """``"192x512"`` -> (in_features, out_features)."""
    try:
        fan_in, fan_out = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layer shape is IN x OUT, e.g. 192x512; got {text!r}") from None
    if fan_in <= 0 or fan_out <= 0:
        raise argparse.ArgumentTypeError(f"layer sizes must be positive, got {text!r}")
    return fan_in, fan_out


def measure(shapes: Sequence[tuple[int, int]], rows: Sequence[int], calls: int, repeats: int
            ) -> dict[tuple[int, int], dict[int, tuple[float, float]]]:
    """``{(in, out): {rows: (F.linear us, packed us)}}`` at the current thread count."""
    results: dict[tuple[int, int], dict[int, tuple[float, float]]] = {}
    for fan_in, fan_out in shapes:
        layer = torch.nn.Linear(fan_in, fan_out)
        packed = pack_weight(layer.weight)
        results[(fan_in, fan_out)] = {}
        with torch.inference_mode():
            for n in rows:
                x = torch.randn(n, fan_in)
                plain_us = time_call(functools.partial(F.linear, x, layer.weight, layer.bias), calls, repeats)
                packed_us = time_call(functools.partial(onednn_linear, x, packed, layer.bias), calls, repeats)
                results[(fan_in, fan_out)][n] = (plain_us, packed_us)
    return results


def table(results_by_threads: dict[int, dict], rows: Sequence[int]) -> str:
    lines = ["| threads | layer (in x out) | " + " | ".join(f"{n} rows" for n in rows) + " |",
             "|---|---|" + "---|" * len(rows)]
    for threads, results in results_by_threads.items():
        for (fan_in, fan_out), cells in results.items():
            row = [f"{plain:.0f} / **{fast:.0f}**" if fast < plain else f"**{plain:.0f}** / {fast:.0f}"
                   for plain, fast in (cells[n] for n in rows)]
            lines.append(f"| {threads} | {fan_in} x {fan_out} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = new_parser(__doc__)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 26, 64])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="markdown file for the table")
    args = parser.parse_args(argv)
    if not onednn_linear_available():
        raise SystemExit("this PyTorch build has no oneDNN linear ops: nothing to compare")
    if min(args.rows) < 1 or min(args.threads) < 1 or args.calls < 1 or args.repeats < 1:
        raise SystemExit("--rows, --threads, --calls and --repeats must be positive")
    results = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        results[threads] = measure(args.shapes, args.rows, args.calls, args.repeats)
    text = (f"Microseconds per fp32 call, `F.linear` / packed oneDNN (faster in bold); torch {torch.__version__}. "
            f"The pipelines route a call to the packed kernel from {DEFAULT_MIN_MACS:,} multiply-adds "
            f"(rows x in x out) on.\n\n{table(results, args.rows)}\n\n"
            f"Command: `{command_line('mmspec.evaluation.bench_gemm', argv)}`\n")
    print(text)
    if args.out is not None:
        write_text_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
