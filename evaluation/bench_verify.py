"""What verification costs next to the LM-head matmul that produced the logits (a benchmark, not a test).

For each batch size B, draft length K and vocabulary V it times, on the CPU or a CUDA GPU (``--device``):

(a) the LM head: ``hidden [B*(K+1), 1024] @ W [1024, V]``, the matmul that produces the logits the
    target verifies with;
(b) the softmax of those logits;
(c) ``mmspec.verify_tokens(draft_tokens, draft_probs, target_probs, rule=ExactRule())`` with draft
    probabilities and with ``draft_probs=None`` (deterministic drafts), and once more with the value
    checks of the probabilities switched off (``mmspec.validation.value_checks(False)``);
(d) the kernel reference ``mmspec.kernels.chain_verify`` (torch backend) with given uniforms, and on a
    GPU the fused Triton kernel (``backend="triton"``) on the same inputs (``verify_tokens`` dispatches
    to it there, so (c) times the Triton path on a GPU).

The goal is verification cheaper than the matmul (ratio < 1). Timings are medians over repeats; the
cases of one configuration are interleaved round-robin so that a neighbour's job on a shared machine
hits them alike, and each sample loops a call enough times to last about 2 ms.

    python -m mmspec.evaluation.bench_verify --out docs/benchmarks/verify_cpu.md
    python -m mmspec.evaluation.bench_verify --device cuda --out docs/benchmarks/verify_h200.md  # on a GPU

writes the markdown table there and the raw numbers next to it (same name, ``.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mmspec.files import write_json_atomic, write_text_atomic

HIDDEN = 1024
CASES = ("matmul", "softmax", "verify_q", "verify_none", "verify_q_nochecks", "chain_verify_ref")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _load_average() -> list[float] | None:
    """1/5/15-minute load averages (a shared machine makes timings noisy; the report says how busy)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _calls_per_sample(fn: Callable[[], object], sync: Callable[[], None], target_s: float = 2e-3) -> int:
    """How many back-to-back calls make one timing sample last about ``target_s``."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, min(1000, int(target_s / once)))


def _time_cases(cases: dict[str, Callable[[], object]], repeats: int,
                sync: Callable[[], None] = lambda: None) -> dict[str, dict[str, float]]:
    """Median and interquartile range of the per-call time (seconds) of each case, interleaved.
    ``sync`` waits for queued device work (``torch.cuda.synchronize`` on a GPU) before a clock is read."""
    for fn in cases.values():  # warm-up (allocator, MKL, kernel compilation, first-call paths)
        for _ in range(3):
            fn()
    loops = {name: _calls_per_sample(fn, sync) for name, fn in cases.items()}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            n = loops[name]
            sync()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            samples[name].append((time.perf_counter() - start) / n)
    out = {}
    for name, values in samples.items():
        q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
        out[name] = {"median_s": statistics.median(values), "q1_s": q[0], "q3_s": q[2], "min_s": min(values),
                     "calls_per_sample": loops[name]}
    return out


def bench_config(B: int, K: int, V: int, repeats: int, seed: int = 0, device: str | torch.device = "cpu",
                 splits: int | None = None) -> dict:
    """Time every case for one (B, K, V) on ``device`` (inputs drawn on the CPU, then moved there); on a GPU
    with ``splits``, the split-V kernel too (up to ``splits`` programs per row)."""
    from mmspec import ExactRule, verify_tokens
    from mmspec.kernels import chain_verify
    from mmspec.validation import value_checks

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B * (K + 1), HIDDEN, generator=g)  # [B*(K+1), H]
    head = torch.randn(HIDDEN, V, generator=g) / HIDDEN**0.5  # [H, V]
    logits = hidden @ head  # [B*(K+1), V]
    target_probs = logits.softmax(-1).view(B, K + 1, V)
    # A drafter that is close to the target but not equal to it: realistic acceptance lengths.
    draft_logits = logits.view(B, K + 1, V)[:, :K] + 0.5 * torch.randn(B, K, V, generator=g)
    draft_probs = draft_logits.softmax(-1)  # [B, K, V]
    draft_tokens = torch.multinomial(draft_probs.reshape(B * K, V), 1, generator=g).view(B, K)
    accept_u = torch.rand(B, K, generator=g)
    sample_u = torch.rand(B, generator=g)
    device = torch.device(device)
    hidden, head, logits, target_probs, draft_probs, draft_tokens, accept_u, sample_u = (
        t.to(device) for t in (hidden, head, logits, target_probs, draft_probs, draft_tokens, accept_u, sample_u))
    rule = ExactRule()

    def verify_nochecks():
        with value_checks(False):
            return verify_tokens(draft_tokens, draft_probs, target_probs, rule=rule, generator=gen)

    gen = torch.Generator(device=device).manual_seed(seed + 1)
    cases = {
        "matmul": lambda: hidden @ head,
        "softmax": lambda: logits.softmax(-1),
        "verify_q": lambda: verify_tokens(draft_tokens, draft_probs, target_probs, rule=rule, generator=gen),
        "verify_none": lambda: verify_tokens(draft_tokens, None, target_probs, rule=rule, generator=gen),
        "verify_q_nochecks": verify_nochecks,
        "chain_verify_ref": lambda: chain_verify(draft_tokens, draft_probs, target_probs, accept_u, sample_u,
                                                 backend="torch"),
    }
    sync = lambda: None  # noqa: E731
    if device.type == "cuda":
        cases["chain_verify_triton"] = lambda: chain_verify(draft_tokens, draft_probs, target_probs, accept_u,
                                                            sample_u, backend="triton")
        if splits:
            cases["chain_verify_split"] = lambda: chain_verify(draft_tokens, draft_probs, target_probs, accept_u,
                                                               sample_u, backend="triton", splits=splits)
        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    timings = _time_cases(cases, repeats, sync)
    extra = {}
    checks = {"chain_verify_triton": "triton_equals_reference", "chain_verify_split": "split_equals_reference"}
    for kernel, key in checks.items():  # a timed kernel must pick the reference's tokens
        if kernel in cases:
            extra[key] = all(torch.equal(a, b) for a, b in zip(cases[kernel](), cases["chain_verify_ref"]()))
    accepted = verify_tokens(draft_tokens, draft_probs, target_probs, rule=rule,
                             generator=torch.Generator(device=device).manual_seed(seed)).num_accepted
    return {"B": B, "K": K, "V": V, "splits": splits if "chain_verify_split" in cases else None, "timings": timings,
            "mean_accepted": float(accepted.float().mean()), **extra}


def to_markdown(results: list[dict], meta: dict) -> str:
    us = lambda r, c: r["timings"][c]["median_s"] * 1e6  # noqa: E731
    triton = all("chain_verify_triton" in r["timings"] for r in results)
    split = all("chain_verify_split" in r["timings"] for r in results)
    lines = [
        f"Verification cost vs. the LM-head matmul ({meta['device']}, {meta.get('gpu') or meta['cpu']}, "
        f"torch {meta['torch']}, torch.set_num_threads({meta['threads']}), median of {meta['repeats']} "
        f"interleaved repeats, {meta['date']}; load average at start {meta['load_average_at_start']}).",
        "",
        "Times in microseconds. *matmul*: `[B*(K+1), 1024] @ [1024, V]`; *verify (q)*: "
        "`verify_tokens(..., rule=ExactRule())` with draft probabilities; *verify (None)*: deterministic "
        "drafts; *verify (q, no checks)*: the same under `value_checks(False)`; *chain_verify ref*: "
        "`mmspec.kernels.chain_verify(..., backend=\"torch\")` with given uniforms. Ratios are over the "
        "matmul; below 1 meets the goal."
        + (" *chain_verify triton*: the fused Triton kernel on the same inputs (`backend=\"triton\"`; "
           "`verify_tokens` dispatches to it on a GPU); *same*: its tokens equal the reference's." if triton else "")
        + (f" *split-V*: the split-V kernels with up to {results[0]['splits']} programs per row "
           f"(`splits={results[0]['splits']}`), and whether their tokens equal the reference's." if split else ""),
        "",
        "| B | K | V | matmul | softmax | verify (q) | verify (None) | verify (q, no checks) | chain_verify ref "
        + ("| chain_verify triton | same " if triton else "")
        + ("| split-V | same " if split else "")
        + "| verify (q) / matmul | verify (None) / matmul | chain_verify ref / matmul |"
        + (" chain_verify triton / matmul |" if triton else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if triton else "")
        + ("---|---|" if split else ""),
    ]
    for r in results:
        m = us(r, "matmul")
        kernel = (f" {us(r, 'chain_verify_triton'):.0f} | {'yes' if r['triton_equals_reference'] else 'NO'} |"
                  if triton else "")
        if split:
            kernel += f" {us(r, 'chain_verify_split'):.0f} | {'yes' if r['split_equals_reference'] else 'NO'} |"
        kernel_ratio = f" {us(r, 'chain_verify_triton') / m:.2f} |" if triton else ""
        lines.append(
            f"| {r['B']} | {r['K']} | {r['V']} | {m:.0f} | {us(r, 'softmax'):.0f} | {us(r, 'verify_q'):.0f} | "
            f"{us(r, 'verify_none'):.0f} | {us(r, 'verify_q_nochecks'):.0f} | {us(r, 'chain_verify_ref'):.0f} |"
            f"{kernel} {us(r, 'verify_q') / m:.2f} | {us(r, 'verify_none') / m:.2f} | "
            f"{us(r, 'chain_verify_ref') / m:.2f} |{kernel_ratio}")
    lines += ["", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Cost of verify_tokens relative to the LM-head matmul.")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/verify_cpu.md"),
                        help="markdown output; the JSON goes next to it with the suffix .json")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda to time the GPU path (Triton kernel included)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--draft-len", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--vocab", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--splits", type=int, default=None,
                        help="with --device cuda: also time the split-V kernels, up to this many programs per row")
    parser.add_argument("--threads", type=int, nargs="+", default=[2],
                        help="torch.set_num_threads values; one table per value")
    args = parser.parse_args(argv)
    for name in ("batch", "draft_len", "vocab", "threads"):
        if any(v <= 0 for v in getattr(args, name)):
            raise ValueError(f"--{name.replace('_', '-')} values must be positive integers")
    if args.splits is not None and args.splits < 2:
        raise ValueError("--splits must be at least 2 (1 is the fused kernel, timed anyway)")
    if args.splits is not None and args.device == "cpu":
        raise ValueError("--splits times a Triton kernel: it needs --device cuda")
    if args.repeats < 3:
        raise ValueError("--repeats must be at least 3")
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {args.device}: torch sees no CUDA GPU on this machine")

    defaults = {"device": "cpu", "repeats": 21, "threads": [2], "batch": [1, 8], "draft_len": [4, 8], "vocab": [1024, 16384],
                "splits": None}
    options = [f"--out {args.out}"]
    for name, default in defaults.items():
        value = getattr(args, name)
        if value != default:
            shown = " ".join(map(str, value)) if isinstance(value, list) else str(value)
            options.append(f"--{name.replace('_', '-')} {shown}")
    command = "python -m mmspec.evaluation.bench_verify " + " ".join(options)

    tables, runs = [], []
    for threads in args.threads:
        torch.set_num_threads(threads)
        meta = {"device": "CUDA" if device.type == "cuda" else "CPU", "cpu": _cpu_name(),
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "torch": torch.__version__, "threads": torch.get_num_threads(),
                "repeats": args.repeats, "date": dt.date.today().isoformat(), "command": command,
                "python": platform.python_version(), "load_average_at_start": _load_average()}
        results = []
        for B in args.batch:
            for K in args.draft_len:
                for V in args.vocab:
                    r = bench_config(B, K, V, args.repeats, device=device, splits=args.splits)
                    results.append(r)
                    t = r["timings"]
                    print(f"threads={threads} B={B} K={K} V={V}: matmul {t['matmul']['median_s'] * 1e6:.0f} us, "
                          f"verify(q) {t['verify_q']['median_s'] * 1e6:.0f} us "
                          f"({t['verify_q']['median_s'] / t['matmul']['median_s']:.2f}x)", flush=True)
        tables.append(to_markdown(results, meta))
        runs.append({"meta": meta, "results": results})
    markdown = "\n".join(tables)
    write_text_atomic(args.out, markdown)
    write_json_atomic(args.out.with_suffix(".json"), {"runs": runs})
    print(markdown)


if __name__ == "__main__":
    main()
