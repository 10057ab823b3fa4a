"""Token-level rows (AR images, VLMs): a method, an acceptance rate and a batch through the pipeline's own loop.

A run does what the pipeline's ``__call__`` does between encoding and decoding: ``pipe.build_method`` resolves
the method (the pipeline's settings for a plain ``method=name`` call, greedy, this batch) and builds its
drafter and rule, the pipeline's target runner wraps the target, and :func:`~mmspec.speculate.speculative_generate`
runs (no EOS: every row generates ``new_tokens``). The drafter is wrapped by
:class:`~.controlled.ControlledDrafter`, the target by a :class:`~.timing.TimedProxy`.

What a row reports (per run, then the median over ``--repeats`` unless said otherwise):

* ``K``: drafting steps per round (a chain's length, a tree's depth); ``nodes``: tokens drafted per round (K
  for a chain, the node count of a ``"NAME+tree"`` method's EAGLE-2 tree);
* ``t1_ms``: the target's mean forward on 1 token per row, in the target-only run (its cache grows from the
  prompt to prompt + N: realistic prefix lengths); ``tk1_ms``: its mean forward on nodes + 1 tokens in the
  speculative run (means, not medians, so that forward time times forward count is the run's model time);
  the formulas below write it T(K+1), a chain's case;
* ``draft_ms``: the drafter's time per drafting step (its propose and commit per round over K);
* ``tau``: measured tokens per (row, round) (:attr:`~mmspec.stats.SpecStats.mean_accepted_length`) next to
  ``tau_expected`` = (1 - alpha^(K+1)) / (1 - alpha); ``tau_rounds``: (N - 1) / rounds, which is what a
  batch's speed follows (the loop runs until its slowest row is done) and equals ``tau`` at batch 1;
* ``speedup``: target-only decode time over speculative decode time (prefills excluded; ``speedup_range`` over
  the repeats, ``speedup_e2e`` with prefills);
* ``bound`` = tau_rounds * T(1) / (T(K+1) + K * T_draft): the speedup if the loop cost nothing but its
  forwards; ``efficiency`` = speedup / bound;
* ``loop_ms``: per round, the decode time minus the target's forwards, the drafter's work and the controlled
  wrapper's own (which is not the product's); ``loop_pct``: that over T(K+1);
* ``peak_mb``: peak memory of the speculative run (``mem_source`` says how it was read).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from mmspec.drafters import TreeConfig
from mmspec.speculate import speculative_generate
from mmspec.stats import SpecStats

from ..speed import MemoryProbe, seed_everything
from .builders import System
from .controlled import ControlledDrafter, expected_tau
from .timing import TimedProxy, Timer, profile_call

#: tokens of a warm-up run (first calls build lazy state: derived weights, caches, kernels)
WARMUP_TOKENS = 6
#: a method name with this suffix runs the method's settings with EAGLE-2's dynamic tree (:func:`method_config`)
TREE_SUFFIX = "+tree"
#: a row is profiled when its loop takes more than this share of a verification forward...
LOOP_SHARE_LIMIT = 5.0
#: ...or when a chain method at batch 1 reaches less than this share of its bound
EFFICIENCY_LIMIT = 0.9


@dataclass
class LoopRun:
    """One run of a loop: its output, wall time, prefill time, statistics and timings."""

    sequences: torch.Tensor
    wall: float
    prefill: float
    stats: SpecStats
    timer: Timer
    config: dict[str, Any] | None
    mismatches: int = 0
    round_lengths: tuple[int, ...] = ()
    round_depths: tuple[int, ...] = ()
    peak_bytes: int | None = None
    start_bytes: int | None = None

    @property
    def decode(self) -> float:
        """Seconds after both prefills (the loop's rounds)."""
        return self.wall - self.prefill


def method_config(system: System, method: str, request: Any) -> Any:
    """What ``method`` names: a method of the pipeline (``"eagle"``: the settings a plain call resolves), or
    ``"NAME+tree"``: those settings with EAGLE-2's dynamic tree (``TreeConfig()``: depth 5, top-k 8, 48
    nodes) instead of their chain."""
    if not method.endswith(TREE_SUFFIX):
        return method
    return system.pipe.resolve_method(method[:-len(TREE_SUFFIX)], request).replace(tree=TreeConfig())


def run_loop(system: System, method: str, batch: int, new_tokens: int, seed: int, *, detailed: bool,
             alpha: float | None = None, reference: torch.Tensor | None = None) -> LoopRun:
    """One greedy run of ``method`` ("none": target only) on ``batch`` rows, as the pipeline runs its loop."""
    timer = Timer(system.device, detailed)
    generator = torch.Generator(system.device).manual_seed(seed)
    request = system.request(batch, generator)
    config, plan = system.pipe.build_method(method_config(system, method, request), request)
    if plan.loop is not None:
        raise ValueError(f"method {method!r} runs a loop of its own; token rows drive the token loop")
    drafter = plan.drafter
    if drafter is not None:
        if reference is None or alpha is None:
            raise ValueError("a speculative run needs the target-only run's tokens (reference) and alpha")
        drafter = ControlledDrafter(drafter, reference, alpha, system.token_limit, timer, seed)
    target = TimedProxy(system.target_runner(drafter, config), timer,
                        {"prefill": "target_prefill", "forward": "target_forward"})
    input_ids, mask, inputs = system.loop_inputs(batch, seed)
    probe = MemoryProbe(system.device.type)
    seed_everything(seed)
    with torch.inference_mode():
        start_bytes = probe.start()
        timer.sync()
        start = time.perf_counter()
        out = speculative_generate(target, drafter, input_ids, mask, max_new_tokens=new_tokens,
                                   sampling=request.sampling, rule=plan.rule, generator=generator,
                                   **(system.loop_kwargs or {}), **inputs)
        timer.sync()
        wall = time.perf_counter() - start
        peak = probe.stop()
    controlled = drafter if isinstance(drafter, ControlledDrafter) else None
    return LoopRun(out.sequences, wall, timer.total("target_prefill", "draft_prefill"), out.stats, timer,
                   None if config is None else config.to_dict(),
                   mismatches=controlled.mismatches if controlled else 0,
                   round_lengths=tuple(controlled.round_lengths) if controlled else (),
                   round_depths=tuple(controlled.round_depths) if controlled else (),
                   peak_bytes=peak, start_bytes=start_bytes)


def repeated(run: Callable[..., LoopRun], repeats: int, instrumented_separately: bool) -> tuple[list, list]:
    """``repeats`` timed runs of ``run(detailed=...)`` and the instrumented ones: the same runs on a CPU
    (timing every forward costs nothing there), one extra instrumented run on a GPU (where it would cost
    synchronisations)."""
    if not instrumented_separately:
        runs = [run(detailed=True) for _ in range(repeats)]
        return runs, runs
    return [run(detailed=False) for _ in range(repeats)], [run(detailed=True)]


def _median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def chain_length(runs: Sequence[LoopRun]) -> int:
    """The most tokens a run drafted in a round: a chain's K, a tree's node count (rounds near the end may be
    capped shorter)."""
    return max(max(run.round_lengths, default=0) for run in runs)


def draft_depth(runs: Sequence[LoopRun]) -> int:
    """K: the most drafting steps of a round (a chain's length, a tree's depth)."""
    return max(max(run.round_depths, default=0) for run in runs)


def token_row(method: str, alpha: float, batch: int, new_tokens: int, base: tuple[list, list],
              spec: tuple[list, list]) -> dict[str, Any]:
    """The reported quantities of one row from its target-only and speculative runs (``(timed, instrumented)``
    lists of :class:`LoopRun`, as :func:`repeated` returns them)."""
    (base_runs, base_detail), (spec_runs, spec_detail) = base, spec
    k, nodes = draft_depth(spec_detail), chain_length(spec_detail)
    rounds = [run.timer.count("target_forward") for run in spec_detail]
    t1 = _median([run.timer.mean("target_forward", 1) for run in base_detail])
    tk1 = _median([run.timer.mean("target_forward", nodes + 1) for run in spec_detail])
    draft = _median([run.timer.total("draft") / r / k for run, r in zip(spec_detail, rounds) if r and k])
    loop = _median([(run.decode - run.timer.total("target_forward", "draft", "controller")) / r
                    for run, r in zip(spec_detail, rounds) if r])
    steps = [run.timer.count("target_forward") for run in base_detail]
    base_loop = _median([(run.decode - run.timer.total("target_forward")) / s
                         for run, s in zip(base_detail, steps) if s])
    controller = _median([run.timer.total("controller") / r for run, r in zip(spec_detail, rounds) if r])
    tau_rounds = (new_tokens - 1) / statistics.median(rounds) if rounds and statistics.median(rounds) else None
    base_decode = statistics.median(run.decode for run in base_runs)
    ratios = [base_decode / run.decode for run in spec_runs]
    speedup = base_decode / statistics.median(run.decode for run in spec_runs)
    bound = tau_rounds * t1 / (tk1 + k * draft) if None not in (tau_rounds, t1, tk1, draft) else None
    peaks = [run.peak_bytes for run in spec_runs if run.peak_bytes is not None]
    starts = [run.start_bytes for run in spec_runs if run.start_bytes is not None]
    return {
        "method": method, "alpha": alpha, "batch": batch, "new_tokens": new_tokens, "K": k, "nodes": nodes,
        "config": spec_runs[0].config,
        "tau": spec_runs[0].stats.mean_accepted_length, "tau_expected": expected_tau(alpha, k),
        "tau_rounds": tau_rounds, "rounds": _median(rounds),
        "t1_ms": _ms(t1), "tk1_ms": _ms(tk1), "draft_ms": _ms(draft),
        "speedup": speedup, "speedup_range": [min(ratios), max(ratios)],
        "speedup_e2e": statistics.median(r.wall for r in base_runs) / statistics.median(r.wall for r in spec_runs),
        "bound": bound, "efficiency": speedup / bound if bound else None,
        "loop_ms": _ms(loop), "loop_pct": 100 * loop / tk1 if loop is not None and tk1 else None,
        "base_loop_ms": _ms(base_loop), "controller_ms": _ms(controller),
        "base_decode_s": base_decode, "spec_decode_s": statistics.median(run.decode for run in spec_runs),
        "reference_mismatches": max(run.mismatches for run in spec_runs),
        "peak_mb": max(peaks) / 2**20 if peaks else None, "start_mb": min(starts) / 2**20 if starts else None,
    }


def needs_profile(row: dict[str, Any]) -> bool:
    """Whether a row's loop deserves a profile: its own time above :data:`LOOP_SHARE_LIMIT` % of a verification
    pass, or a batch-1 chain below :data:`EFFICIENCY_LIMIT` of its bound."""
    slow_loop = row.get("loop_pct") is not None and row["loop_pct"] > LOOP_SHARE_LIMIT
    inefficient = row.get("K") and row["batch"] == 1 and row.get("efficiency") is not None \
        and row["efficiency"] < EFFICIENCY_LIMIT
    return bool(slow_loop or inefficient)


def token_rows(system: System, methods: Sequence[str], alphas: Sequence[float], batches: Sequence[int],
               new_tokens: int, repeats: int, seed: int, progress: Any = None,
               profile: bool = False) -> list[dict[str, Any]]:
    """Every (method, alpha, batch) row of ``system``: per batch a warm-up, the target-only runs (whose first
    output is the reference continuation), then each method's warm-up and runs per alpha. With ``profile``,
    a row that :func:`needs_profile` gets one more run under cProfile (``row["profile"]``)."""
    separate = system.device.type == "cuda"
    rows = []
    for batch in batches:
        run_loop(system, "none", batch, min(new_tokens, WARMUP_TOKENS), seed, detailed=True)
        base = repeated(partial(run_loop, system, "none", batch, new_tokens, seed), repeats, separate)
        reference = base[0][0].sequences
        _tick(progress)
        for method in methods:
            run_loop(system, method, batch, min(new_tokens, WARMUP_TOKENS), seed, detailed=True, alpha=alphas[0],
                     reference=reference)
            for alpha in alphas:
                run = partial(run_loop, system, method, batch, new_tokens, seed, alpha=alpha, reference=reference)
                row = token_row(method, alpha, batch, new_tokens, base, repeated(run, repeats, separate))
                if profile and needs_profile(row):
                    row["profile"] = profile_call(partial(run, detailed=False))
                rows.append(row)
                _tick(progress)
    return rows


def _tick(progress: Any) -> None:
    if progress is not None:
        progress.update(1)
