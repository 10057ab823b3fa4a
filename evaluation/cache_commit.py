"""What a speculative round's commit costs on a transformers ``DynamicCache``, by context length.

After verification the core keeps each row's accepted slots (:func:`mmspec.cache.select_cache_slots`).
On a transformers cache it moves the kept slots down in place and leaves each layer a view of its first
``start + M`` slots, so a commit copies M slots whatever the context. The straightforward version,
``torch.cat([prefix, gathered])`` per layer (what the core did before), copies the whole cache every
round: as much as transformers' own append of the round's slots (``DynamicLayer.update`` concatenates
too), so it doubled the per-round cache traffic of long (video) prompts. This script times, on a cache
shaped like Qwen2-VL-7B's (28 layers, 4 KV heads of width 128, fp32 here), one round's append (transformers)
and its commit both ways (after a warm-up of both: the first rounds' allocations fault fresh pages in and
would bias whichever runs first), and checks that the two commits leave equal caches.

    python -m mmspec.evaluation.cache_commit [--contexts 1000 4000 16000] [--threads 2]
    python -m mmspec.evaluation.cache_commit --vlm-zoo 4 --threads 1   # end to end on mmspec/shapes-vlm

``--vlm-zoo N`` instead times greedy ``VLMPipeline`` decoding (``none`` and ``eagle``) of N held-out image
descriptions on the zoo (a transformers LLaVA, so a ``DynamicCache``) with each commit, the two runs
alternating, and reports the median of ``--repeats`` (after one untimed pass each).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mmspec.cache import KVCache, select_cache_slots


def commit_by_concatenation(cache: Any, start: int, index: torch.Tensor) -> None:
    """The out-of-place commit (the reference): each layer becomes ``cat([prefix, kept slots])``."""
    for layer in cache.layers:
        slots = (start + index.clamp_min(0)).reshape(index.shape[0], 1, index.shape[1], 1)
        slots = slots.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys.gather(2, slots)], 2)
        layer.values = torch.cat([layer.values[:, :, :start], layer.values.gather(2, slots)], 2)


@contextmanager
def concatenating_commits() -> Iterator[None]:
    """Inside the block the runners' gathering commits (selections that are not a crop) of transformers
    caches concatenate (the reference); crops stay crops."""
    import mmspec.runner as runner

    original = runner.move_cache_slots

    def select(cache: Any, start: int, index: torch.Tensor) -> Any:
        if isinstance(cache, KVCache) or getattr(cache, "layers", None) is None:  # not a transformers cache
            return original(cache, start, index)
        commit_by_concatenation(cache, start, index)
        return cache

    runner.move_cache_slots = select
    try:
        yield
    finally:
        runner.move_cache_slots = original


def vlm_zoo_ab(examples: int, repeats: int, pipeline: str = "mmspec/shapes-vlm") -> list[dict[str, Any]]:
    """Median seconds of greedy ``none`` / ``eagle`` decoding of ``examples`` image descriptions with the
    in-place and the concatenating commit (alternating runs; the texts must agree)."""
    from contextlib import nullcontext

    from mmspec.pipelines import VLMPipeline

    from .bench_cli import load_quiet_pipeline
    from .bench_vlm import pipeline_case, task_examples

    pipe = load_quiet_pipeline(VLMPipeline, pipeline)
    cases = task_examples("image", examples, 0)
    rows = []
    for method in ("none", "eagle"):
        call = pipeline_case(pipe, cases, method, {"do_sample": False}, 1, 256, 0)
        seconds: dict[str, list[float]] = {"in_place": [], "concatenate": []}
        texts = {}
        for repeat in range(repeats + 1):
            for commit in seconds:
                with nullcontext() if commit == "in_place" else concatenating_commits():
                    start = time.perf_counter()
                    texts[commit] = call().output
                    if repeat:  # the first pass of each warms up
                        seconds[commit].append(time.perf_counter() - start)
        if texts["in_place"] != texts["concatenate"]:
            raise RuntimeError(f"{method}: the two commits decoded different texts")
        rows.append({"method": method, **{k: sorted(v)[len(v) // 2] for k, v in seconds.items()}})
    return rows


def time_rounds(context: int, *, layers: int, kv_heads: int, head_dim: int, round_slots: int, kept: int,
                rounds: int, commit: str) -> tuple[float, float, Any]:
    """Mean milliseconds of a round's append and of its commit (``"in_place"`` or ``"concatenate"``) on a
    one-row cache of ``context`` slots; returns them with the final cache."""
    from transformers import DynamicCache, LlamaConfig

    config = LlamaConfig(num_hidden_layers=layers, num_attention_heads=kv_heads, num_key_value_heads=kv_heads,
                         hidden_size=kv_heads * head_dim)
    generator = torch.Generator().manual_seed(0)
    cache = DynamicCache(config=config)
    for layer in range(layers):
        cache.update(torch.randn(1, kv_heads, context, head_dim, generator=generator),
                     torch.randn(1, kv_heads, context, head_dim, generator=generator), layer)
    index = torch.arange(kept).unsqueeze(0)  # the accepted prefix of the round: slots 0..kept-1
    append_s = commit_s = 0.0
    for _ in range(rounds):
        new = [(torch.randn(1, kv_heads, round_slots, head_dim, generator=generator),
                torch.randn(1, kv_heads, round_slots, head_dim, generator=generator)) for _ in range(layers)]
        start = time.perf_counter()
        for layer, (keys, values) in enumerate(new):
            cache.update(keys, values, layer)
        middle = time.perf_counter()
        round_start = cache.get_seq_length() - round_slots
        if commit == "in_place":
            select_cache_slots(cache, round_start, index)
        else:
            commit_by_concatenation(cache, round_start, index)
        append_s, commit_s = append_s + middle - start, commit_s + time.perf_counter() - middle
    return 1e3 * append_s / rounds, 1e3 * commit_s / rounds, cache


def run(args: argparse.Namespace) -> list[dict[str, float]]:
    rows = []
    shape = dict(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, round_slots=args.round_slots,
                 kept=args.kept, rounds=args.rounds)
    for context in args.contexts:
        for commit in ("in_place", "concatenate"):  # warm-up: the first large allocations fault their pages in
            time_rounds(context, commit=commit, **{**shape, "rounds": 2})
        append_ms, in_place_ms, cache = time_rounds(context, commit="in_place", **shape)
        append_before_ms, concat_ms, reference = time_rounds(context, commit="concatenate", **shape)
        for got, ref in zip(cache.layers, reference.layers):
            if not (torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values)):
                raise RuntimeError(f"the in-place commit left another cache than concatenation at context {context}")
        rows.append({"context": context, "append_ms": append_ms, "in_place_ms": in_place_ms,
                     "append_before_ms": append_before_ms, "concat_ms": concat_ms})
    return rows


def markdown(rows: list[dict[str, float]], args: argparse.Namespace) -> str:
    lines = [f"One-row DynamicCache, {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} (fp32), rounds "
             f"of {args.round_slots} slots keeping {args.kept}, mean of {args.rounds} rounds, {args.threads} thread(s):",
             "", "| context (slots) | now: append (transformers) | now: commit in place | before: append | "
             "before: commit by concatenation |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['context']} | {row['append_ms']:.1f} ms | {row['in_place_ms']:.1f} ms | "
                     f"{row['append_before_ms']:.1f} ms | {row['concat_ms']:.1f} ms |")
    return "\n".join(lines)


def zoo_markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"Greedy VLMPipeline decoding of {args.vlm_zoo} held-out image descriptions on mmspec/shapes-vlm, "
             f"median of {args.repeats} alternating runs, {args.threads} thread(s):", "",
             "| method | commit in place (now) | commit by concatenation (before) | time saved |", "|---|---|---|---|"]
    for row in rows:
        saved = 1 - row["in_place"] / row["concatenate"]
        lines.append(f"| {row['method']} | {row['in_place']:.2f} s | {row['concatenate']:.2f} s | {100 * saved:.0f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Cost of a speculative round's commit on a transformers cache.")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1000, 4000, 16000])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--round-slots", type=int, default=9, help="slots a round appends (pending + 8 drafts)")
    parser.add_argument("--kept", type=int, default=5, help="slots a round keeps")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vlm-zoo", type=int, default=0, metavar="N",
                        help="time greedy decoding of N image descriptions on the VLM zoo with each commit instead")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per commit with --vlm-zoo")
    args = parser.parse_args(argv)
    for name in ("layers", "kv_heads", "head_dim", "round_slots", "kept", "rounds", "threads", "repeats"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.kept > args.round_slots or min(args.contexts) <= 0:
        parser.error("--kept must be <= --round-slots and every context positive")
    torch.set_num_threads(args.threads)
    if args.vlm_zoo:
        print(zoo_markdown(vlm_zoo_ab(args.vlm_zoo, args.repeats), args))
        return
    print(markdown(run(args), args))


if __name__ == "__main__":
    main()
