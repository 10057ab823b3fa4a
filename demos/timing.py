"""How the demo times a speculative method against the target-only baseline, and what it trusts.

The protocol is the CLI's and the benchmarks' (:func:`mmspec.evaluation.speed.run_benchmark`): one untimed
warm-up call of each side, then ``repeats`` timed calls alternating baseline / method (more for calls so short
that a few would take under :data:`MIN_TIMED_SECONDS`), every call with the same inputs and a fresh generator
from the same seed. The speedup is the ratio of the median times; its range
is the lowest and highest ratio within one alternating pass (a drift of the machine between passes does not
move it). A speedup that the call counts cannot explain (much above the ratio of tokens per target call) is
flagged: it means the timing was disturbed, and the page never shows it as a result.

:class:`RunSlot` is the app's single generation slot: one run at a time across all tabs, so two runs never
slow each other down, and a waiting run can say what it waits for. Nothing here imports gradio.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

#: timed calls per side unless the page asks for another number
DEFAULT_REPEATS = 3
MAX_REPEATS = 10
#: short calls get more timed passes, until the faster side's would take about this long (up to MAX_REPEATS)
MIN_TIMED_SECONDS = 3.0
#: a speedup more than this factor above the call counts' ideal speedup is flagged as a disturbed timing
PLAUSIBLE_MARGIN = 1.3
#: paired speedups whose highest is more than this factor above the lowest are reported as a noisy machine
NOISY_SPREAD = 1.25

Report = Callable[[float, str], None]
Run = Callable[[str, torch.Generator, Callable[[float], None]], Any]


def seeded(seed: int) -> torch.Generator:
    """The generator of one call: every call of a comparison gets a fresh one from the same seed."""
    return torch.Generator().manual_seed(int(seed))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


@dataclass
class Comparison:
    """The speculative method and the target-only baseline on one request, timed by :func:`compare`.

    Attributes:
        method: the speculative method's name.
        speculative / baseline: the outputs of each side's last timed call (each with ``stats``).
        spec_times / base_times: seconds of each timed call, in the order run (pass ``i`` of both sides
            ran back to back).
        lossless: whether the method keeps the target's output distribution (the page then says whether
            the result is identical to the baseline instead of showing a quality figure).
        quality: for a lossy method, ``(what, speculative value, baseline value)`` or None when no figure
            applies to these inputs.
        notes: extra lines for the statistics panel.
        extra: extra statistics rows ``name -> (speculative value, baseline value)`` (strings).
    """

    method: str
    speculative: Any
    baseline: Any
    spec_times: list[float]
    base_times: list[float]
    lossless: bool = False
    quality: tuple[str, str, str] | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: what else ran on the machine during the timed calls (:class:`mmspec.evaluation.speed.MachineLoad`;
    #: None when not measured)
    load: Any = None

    @property
    def contended(self) -> bool:
        """Whether other processes used more than a quarter of a core during the timed calls."""
        return bool(self.load is not None and self.load.contended)

    @property
    def spec_seconds(self) -> float:
        """Median seconds of the speculative calls."""
        return _median(self.spec_times)

    @property
    def base_seconds(self) -> float:
        """Median seconds of the baseline calls."""
        return _median(self.base_times)

    @property
    def repeats(self) -> int:
        return len(self.spec_times)

    @property
    def speedup(self) -> float:
        """Ratio of the median times (baseline over speculative)."""
        return self.base_seconds / self.spec_seconds if self.spec_seconds > 0 else math.nan

    @property
    def speedup_range(self) -> tuple[float, float]:
        """Lowest and highest ratio baseline / speculative within one alternating pass."""
        paired = [b / s for b, s in zip(self.base_times, self.spec_times) if s > 0]
        return (min(paired), max(paired)) if paired else (math.nan, math.nan)

    @property
    def ideal_speedup(self) -> float | None:
        """Tokens per target call of the method over the baseline's: the speedup if target passes were the
        only cost (None when the statistics lack the counts)."""
        spec, base = self.speculative.stats, self.baseline.stats
        counts = (getattr(spec, "tokens", None), getattr(spec, "target_calls", None), getattr(base, "tokens", None),
                  getattr(base, "target_calls", None))
        if not all(isinstance(c, (int, float)) and c > 0 for c in counts):
            return None
        return (counts[0] / counts[1]) / (counts[2] / counts[3])

    @property
    def warning(self) -> str | None:
        """Why the measured speedup cannot be trusted (its call counts contradict it), or None."""
        ideal = self.ideal_speedup
        if ideal is None or not self.speedup > PLAUSIBLE_MARGIN * ideal:
            return None
        spec, base = self.speculative.stats, self.baseline.stats
        return (f"not trusted: {self.speedup:.2f}x is more than the call counts allow ({spec.target_calls} against "
                f"{base.target_calls} target calls: about {ideal:.2f}x if target passes were the only cost); another "
                "process probably slowed the timed calls. Run again.")

    @property
    def noisy(self) -> bool:
        """Whether the alternating passes disagree by more than :data:`NOISY_SPREAD`."""
        low, high = self.speedup_range
        return low > 0 and high / low > NOISY_SPREAD

    def summary(self) -> dict[str, Any]:
        """The numbers the page shows (also what tests read)."""
        spec, base = self.speculative.stats, self.baseline.stats
        return {"method": self.method, "spec_seconds": self.spec_seconds, "base_seconds": self.base_seconds,
                "speedup": self.speedup, "speedup_range": self.speedup_range, "repeats": self.repeats,
                "mean_accepted_length": spec.mean_accepted_length,
                "base_mean_accepted_length": base.mean_accepted_length, "target_calls": spec.target_calls,
                "base_target_calls": base.target_calls, "draft_calls": spec.draft_calls, "warning": self.warning,
                "step_compression": self.ideal_speedup, "contended": self.contended}


def check_repeats(repeats: Any) -> int:
    """The number of timed calls per side, an integer in [1, :data:`MAX_REPEATS`]."""
    if isinstance(repeats, bool) or not isinstance(repeats, (int, float)) or repeats != int(repeats) \
            or not 1 <= repeats <= MAX_REPEATS:
        raise ValueError(f"timed repeats must be an integer in [1, {MAX_REPEATS}], got {repeats!r}")
    return int(repeats)


def compare(run: Run, method: str, seed: int, *, repeats: int = DEFAULT_REPEATS,
            report: Report | None = None, min_timed_seconds: float | None = None) -> Comparison:
    """Time ``method`` against the baseline ``"none"`` with the benchmarks' harness: one warm-up call each,
    then at least ``repeats`` alternating timed calls (baseline, method, baseline, method, ...): calls so short
    that ``repeats`` of the faster side would take under ``min_timed_seconds`` (default
    :data:`MIN_TIMED_SECONDS`) get more passes (up to :data:`MAX_REPEATS`), so a fraction of a second of
    machine noise does not decide the speedup.
    ``run(name, generator, progress)`` makes one call with a fresh generator from ``seed``; ``progress(fraction)``
    may report the fraction of that call done, and ``report(overall fraction, description)`` receives the whole
    comparison's progress (the page's progress bar)."""
    from mmspec.evaluation.speed import RunResult, run_benchmark

    repeats = check_repeats(repeats)
    report = report or (lambda fraction, text: None)
    min_timed_seconds = MIN_TIMED_SECONDS if min_timed_seconds is None else min_timed_seconds
    # progress: each call's share of the bar; the timed calls share what the warm-up left once their number is known
    plan = {"calls": 2 * (1 + repeats), "timed": repeats, "share": 1 / (2 * (1 + repeats)), "done": 0.0}
    count = [0]
    outputs: dict[str, Any] = {}

    def case(name: str) -> Callable[[], Any]:
        label = "baseline (target only)" if name == "none" else method

        def call() -> Any:
            text = (f"{label}: call {{}} of {plan['calls']} (1 warm-up and {plan['timed']} timed per side, "
                    "alternating)")
            start, share = plan["done"], plan["share"]
            out = run(name, seeded(seed), lambda f: report(start + min(max(f, 0.0), 1.0) * share,
                                                           text.format(count[0] + 1)))
            count[0] += 1
            plan["done"] = min(1.0, start + share)
            report(plan["done"], text.format(count[0]))
            outputs[name] = out
            tokens = getattr(out.stats, "tokens", None)
            return RunResult(num_items=tokens if isinstance(tokens, int) else 1, stats=out.stats)

        return call

    cases = {"none": case("none"), "method": case(method)}
    warm_seconds = []
    for call in cases.values():  # the warm-up calls, timed to size the timed passes
        begin = time.perf_counter()
        call()
        warm_seconds.append(time.perf_counter() - begin)
    plan["timed"] = max(repeats, min(MAX_REPEATS, math.ceil(min_timed_seconds / max(min(warm_seconds), 1e-6))))
    plan["calls"] = 2 * (1 + plan["timed"])
    plan["share"] = (1.0 - plan["done"]) / (2 * plan["timed"])
    bench = run_benchmark(cases, baseline="none", warmup=0, repeats=plan["timed"], seed=int(seed))
    return Comparison(method, outputs[method], outputs["none"], list(bench.cases["method"].times),
                      list(bench.cases["none"].times), load=bench.load)


def speed_words(speedup: float) -> str:
    """A speedup as people say it: "2.31x faster", "2.9x slower" (never "0.34x faster"), "as fast"."""
    if not speedup > 0 or math.isinf(speedup):
        return "n/a"
    if 0.995 <= speedup < 1.005:
        return "as fast as"
    if speedup >= 1:
        return f"{speedup:.2f}x faster than"
    return f"{1 / speedup:.2f}x slower than"


class RunSlot:
    """One generation at a time for the whole app: :meth:`hold` waits for the slot and records which tab
    holds it, :meth:`holder` says so (what the page tells a run that waits)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: str | None = None

    def holder(self) -> str | None:
        """The tab whose run holds the slot now, or None."""
        return self._holder

    @contextmanager
    def hold(self, tab: str) -> Iterator[None]:
        with self._lock:
            self._holder = tab
            try:
                yield
            finally:
                self._holder = None
