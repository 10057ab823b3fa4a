"""Speed harness shared by every pipeline benchmark.

One process runs the baseline and each method on the same inputs with the same seeds: every call is
preceded by reseeding python, numpy and torch with the same seed, all cases are warmed up first, and the
timed repeats go round-robin over the cases (baseline, A, B, baseline, A, B, ...) so that slow drifts of
the machine (thermal state, a neighbour's job) hit every case alike. Each case reports the median wall
time and its spread, the speedup over the baseline (the ratio of the medians, and the lowest and highest
*paired* ratio: the baseline's time over the case's in the same round-robin pass, which a drift of the
machine between passes does not move), throughput (tokens/s or images/s), the mean accepted
length and the ideal speedup when the case returns speculation statistics, peak memory, and any quality
numbers the case attaches.

A case is a zero-argument callable returning a :class:`RunResult` (or a pipeline output with a
``stats`` attribute, or an int count of produced items)::

    from mmspec.evaluation.speed import RunResult, run_benchmark

    def case(method):
        def run():
            out = pipe(prompts, method=method, generator=torch.Generator().manual_seed(0))
            return RunResult(num_items=out.stats.tokens, stats=out.stats)
        return run

    report = run_benchmark({"none": case("none"), "eagle": case("eagle")}, baseline="none", repeats=5)
    print(report.to_markdown())
    report.to_json("runs/bench.json")
    report.plot("runs/bench.png", quality_key="accuracy")

Statistics objects are duck-typed: anything with ``mean_accepted_length`` (mmspec's ``SpecStats``
counts the bonus token, so target-only decoding has 1.0) is read; with ``tokens`` and ``target_calls``
the harness also reports the *step compression* (``ideal_speedup``): the ratio of tokens per target call of
the case and of the baseline, i.e. the speedup if target forwards were the only cost and cost the same
whatever they verify. They do not: on a CPU a forward over K+1 tokens costs more than a one-token forward,
and drafting costs time. So with per-phase timings (``SpecStats.as_dict()``'s ``phase_seconds`` and
``phase_calls``) each case also gets its *round breakdown* (:class:`RoundBreakdown`): the baseline's T(1),
the case's T(K+1), drafting, verification and the rest per round, the bound
``compression * T(1) / (T(K+1) + T_draft)`` and the efficiency measured / bound.

Machine load: the timed repeats run under a :class:`LoadMonitor`, which records other processes' CPU use
(from /proc/stat, minus this process's own), the load average and the torch thread count. A run where others
used more than :data:`CONTENDED_CORES` of a core on average is *contended*: every forward slows down, which
hides the cost of longer verification forwards and overstates speedups. The benchmarks refuse to write such a
run's table into the repository's docs unless forced, and a forced table says so
(:func:`mmspec.evaluation.bench_cli.write_report`).

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` (reset before each call); on CPU (Linux) the
process's resident-set high-water mark during the call (``VmHWM``, reset through
``/proc/self/clear_refs``), with the increase over the resident set at the start of the call reported
next to it; elsewhere ``ru_maxrss`` (the lifetime peak, which cannot be reset; the report says so).
``trace_python_memory=True`` adds one untimed call per case under ``tracemalloc`` (Python allocations
only; tracemalloc slows the code, so it never runs during timed repeats).
"""

from __future__ import annotations

import gc
import math
import os
import platform
import random
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .files import atomic_path, write_json_atomic


@dataclass
class RunResult:
    """What one call of a benchmark case produced.

    Attributes:
        num_items: tokens (or images, frames) produced by the call.
        wall_time: seconds, when the case measures itself (e.g. excluding set-up); None lets the
            harness time the whole call.
        unit: name of the items ("tokens", "images", "frames").
        stats: speculation statistics (duck-typed; see the module docstring) or None.
        quality: quality numbers of this call's output (e.g. {"accuracy": 0.93, "fid": 12.1}).
        output: the raw output (kept for the caller's inspection, never serialised).
    """

    num_items: int
    wall_time: float | None = None
    unit: str = "tokens"
    stats: Any = None
    quality: dict[str, float] | None = None
    output: Any = field(default=None, repr=False)


def as_run_result(value: Any, unit: str = "tokens") -> RunResult:
    """Accept a RunResult, a pipeline output with ``.stats`` (items = ``stats.tokens``), or an int count."""
    if isinstance(value, RunResult):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return RunResult(num_items=int(value), unit=unit)
    stats = getattr(value, "stats", None)
    if stats is not None and isinstance(getattr(stats, "tokens", None), (int, np.integer)):
        return RunResult(num_items=int(stats.tokens), unit=unit, stats=stats, output=value)
    raise TypeError(
        "a benchmark case must return a RunResult, an int item count, or an output with .stats.tokens; "
        f"got {type(value).__name__}"
    )


#: other processes' average CPU use (in cores) above which a run counts as contended: a quarter of a core
#: already slows every forward and hides how verification cost grows with the tokens it checks
CONTENDED_CORES = 0.25


def _process_jiffies(stat: str) -> tuple[int, int]:
    """(parent pid, utime + stime + cutime + cstime) from a /proc/PID/stat line."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]), sum(int(v) for v in fields[11:15])


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy jiffies of the whole machine, jiffies of this process and all its descendants, live or waited
    for), or None where /proc is missing. Descendants count as this run's own work: a benchmark may run its
    cases in worker processes (vLLM's engine, the systems benchmark's subprocesses)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = _process_jiffies(f.read())[1]
    except (OSError, ValueError, IndexError):
        return None
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                parent, jiffies = _process_jiffies(f.read())
        except (OSError, ValueError, IndexError):  # a process that ended meanwhile
            continue
        children.setdefault(parent, []).append((int(entry.name), jiffies))
    stack = [os.getpid()]
    while stack:
        for pid, jiffies in children.get(stack.pop(), []):
            own += jiffies
            stack.append(pid)
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is inside user)
    return busy, own


@dataclass
class MachineLoad:
    """What else ran on the machine while a benchmark ran.

    Attributes:
        seconds: wall time observed.
        other_cores: other processes' average CPU use in cores (the machine's busy time from /proc/stat
            minus this process's own, over ``seconds``); None where /proc is missing.
        load_average: the 1-minute load average at the end (it lags: recorded, not used to judge).
        cores: logical CPUs; threads: torch's intra-op threads of this process.
    """

    seconds: float
    other_cores: float | None
    load_average: float | None
    cores: int
    threads: int

    @property
    def contended(self) -> bool | None:
        """True when other processes used more than :data:`CONTENDED_CORES` on average (None: unknown)."""
        return None if self.other_cores is None else self.other_cores > CONTENDED_CORES

    def describe(self) -> str:
        """One line for a report: ``"quiet: other processes used 0.02 cores on average over 60 s ..."``."""
        state = {True: "CONTENDED", False: "quiet", None: "load unknown"}[self.contended]
        others = "-" if self.other_cores is None else f"{self.other_cores:.2f}"
        load = "-" if self.load_average is None else f"{self.load_average:.2f}"
        return (f"{state}: other processes used {others} cores on average over {self.seconds:.0f} s "
                f"(limit {CONTENDED_CORES}); load average {load} at the end; {self.cores} cores, "
                f"{self.threads} torch thread(s)")


class LoadMonitor:
    """Measures :class:`MachineLoad` from its construction to :meth:`stop`::

        monitor = LoadMonitor()
        ...  # the benchmark
        load = monitor.stop()
        load.contended  # other processes used more than a quarter of a core on average
    """

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._jiffies = _cpu_jiffies()

    def stop(self) -> MachineLoad:
        seconds = time.perf_counter() - self._start
        now = _cpu_jiffies()
        others = None
        if self._jiffies is not None and now is not None and seconds > 0:
            hertz = os.sysconf("SC_CLK_TCK")
            busy, own = now[0] - self._jiffies[0], now[1] - self._jiffies[1]
            others = max(busy - own, 0) / hertz / seconds
        try:
            load_average: float | None = os.getloadavg()[0]
        except OSError:
            load_average = None
        return MachineLoad(seconds, others, load_average, os.cpu_count() or 1, torch.get_num_threads())


@dataclass
class RoundBreakdown:
    """Where a speculative round's time goes, against the baseline's one-token round (milliseconds).

    The bound is what the method could reach if its rounds cost only the verification forward and the
    drafting: ``compression * T(1) / (T(K+1) + T_draft)``, with T(1) target-only's whole round (its one-token
    forward and the sampling after it); ``efficiency`` is the measured end-to-end speedup over it (below 1 by
    the method's verification arithmetic and bookkeeping, and by the prefill and decoding both share), pass by
    pass (:func:`median_breakdown`).

    Attributes:
        compression: step compression: tokens per target forward over the baseline's.
        t1_ms: the baseline's round: its target forward (one token per row) and its sampling; forward_1_ms:
            that forward alone; tk1_ms: the method's verification forward (its K+1 tokens); draft_ms,
            verify_ms, commit_ms: per round; rest_ms: the rest of the call per round (prefill, decoding,
            anything outside the phases).
        rounds: the method's target forwards after prefill (per call).
    """

    compression: float
    t1_ms: float
    forward_1_ms: float
    tk1_ms: float
    draft_ms: float
    verify_ms: float
    commit_ms: float
    rest_ms: float
    rounds: float
    bound: float
    efficiency: float | None = None


def round_breakdown(case_stats: Mapping[str, Any] | None, base_stats: Mapping[str, Any] | None,
                    compression: float | None, wall_s: float) -> RoundBreakdown | None:
    """The :class:`RoundBreakdown` of a case from its statistics and the baseline's (``SpecStats.as_dict()``
    of one call each), or None when either lacks per-phase counts (not a round-based loop)."""
    if not case_stats or not base_stats or not compression:
        return None
    calls, base_calls = case_stats.get("phase_calls") or {}, base_stats.get("phase_calls") or {}
    seconds, base_seconds = case_stats.get("phase_seconds") or {}, base_stats.get("phase_seconds") or {}
    rounds, base_rounds = calls.get("target", 0), base_calls.get("target", 0)
    if not rounds or not base_rounds:
        return None

    def per_round(phase: str) -> float:
        return 1000 * seconds.get(phase, 0.0) / rounds

    forward_1 = 1000 * base_seconds.get("target", 0.0) / base_rounds
    t1 = 1000 * sum(base_seconds.get(phase, 0.0) for phase in ("target", "verify", "commit")) / base_rounds
    tk1, draft = per_round("target"), per_round("draft")
    verify, commit = per_round("verify"), per_round("commit")
    rest = 1000 * wall_s / rounds - tk1 - draft - verify - commit
    bound = compression * t1 / (tk1 + draft) if tk1 + draft > 0 else float("inf")
    return RoundBreakdown(compression, t1, forward_1, tk1, draft, verify, commit, rest, rounds, bound)


def median_breakdown(passes: list[tuple[Any, Any, float, float]], compression: float | None) -> RoundBreakdown | None:
    """The round breakdown of a case over its timed passes: ``passes`` holds, per round-robin pass, the case's
    statistics, the baseline's, and the two wall times. Each pass is broken down on its own (its phases with its
    wall time, its efficiency against that pass's speedup), then every field is the median over the passes, so a
    pass the machine slowed moves no field and phases are never set against another call's wall time."""
    parts = []
    for case_stats, base_stats, case_s, base_s in passes:
        part = round_breakdown(case_stats, base_stats, compression, case_s)
        if part is not None and case_s > 0 and math.isfinite(part.bound) and part.bound > 0:
            part.efficiency = (base_s / case_s) / part.bound
            parts.append(part)
    if not parts:
        return None
    return RoundBreakdown(**{name: statistics.median(getattr(p, name) for p in parts)
                             for name in RoundBreakdown.__dataclass_fields__})


@dataclass
class CaseReport:
    """Timings and measurements of one case over the timed repeats."""

    name: str
    unit: str
    num_items: int
    times: list[float]
    median_s: float
    min_s: float
    max_s: float
    iqr_s: float  # interquartile range of the repeat times
    items_per_s: float
    speedup: float | None = None  # baseline median / this median
    #: lowest and highest ratio baseline time / this case's time over the round-robin passes (each pass
    #: times every case once, one after the other): how far the speedup moves with the machine's state
    paired_speedup_range: tuple[float, float] | None = None
    #: median of those per-pass ratios: unlike the ratio of the medians, a pass slowed down by the machine
    #: moves it only when it slows the baseline and the case unequally, and one such pass barely moves it
    paired_speedup_median: float | None = None
    mean_accepted_length: float | None = None
    tokens_per_target_call: float | None = None
    ideal_speedup: float | None = None  # tokens per target call relative to the baseline
    peak_memory_bytes: int | None = None
    peak_memory_increase_bytes: int | None = None
    python_peak_bytes: int | None = None
    quality: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] | None = None
    #: the round breakdown against the baseline (token loops; None for the baseline and other loops)
    breakdown: RoundBreakdown | None = None


#: how tables written with :func:`speedup_cell` read
SPEEDUP_CELL_NOTE = ("speedup: ratio of the medians, in brackets the lowest and highest ratio within one "
                     "round-robin pass")


#: how a round breakdown table (:meth:`BenchmarkReport.breakdown_markdown`) reads
BREAKDOWN_NOTE = ("milliseconds per round; compression = tokens per target forward over target-only's; T(1) = "
                  "target-only's round (one-token forward and sampling); T(K+1) = the method's verification "
                  "forward; bound = compression x T(1) / (T(K+1) + draft); efficiency = measured speedup / bound")


def speedup_cell(case: Mapping[str, Any]) -> str:
    """A table cell for a case's speedup (a :class:`CaseReport` as a dict): ``"2.54x (2.41-2.66)"``, the ratio
    of the medians and in brackets the paired range across passes (reports written before the range was
    recorded, and the baseline, show the ratio alone)."""
    cell = f"{case['speedup']:.2f}x"
    paired = case.get("paired_speedup_range")
    if paired and not (paired[0] == paired[1] == 1.0):
        cell += f" ({paired[0]:.2f}-{paired[1]:.2f})"
    return cell


@dataclass
class BenchmarkReport:
    """All cases of one benchmark plus the run's settings (see :func:`run_benchmark`)."""

    cases: dict[str, CaseReport]
    baseline: str
    meta: dict[str, Any]

    # -- serialisation -----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"baseline": self.baseline, "meta": self.meta, "cases": {k: asdict(v) for k, v in self.cases.items()}}

    def to_json(self, path: str | Path) -> Path:
        """Write the report as JSON (atomically: temporary file, then rename)."""
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> BenchmarkReport:
        cases = {}
        for name, fields in data["cases"].items():
            fields = dict(fields)
            if fields.get("breakdown") is not None:
                fields["breakdown"] = RoundBreakdown(**fields["breakdown"])
            cases[name] = CaseReport(**fields)
        return cls(cases, data["baseline"], data["meta"])

    @property
    def load(self) -> MachineLoad | None:
        """What else ran on the machine during the timed repeats (None for reports written before it was
        recorded)."""
        load = self.meta.get("load")
        return MachineLoad(**load) if load else None

    def breakdown_markdown(self) -> str:
        """A markdown table of every case's round breakdown (:class:`RoundBreakdown`), milliseconds per round."""
        headers = ["method", "compression", "T(1) ms", "T(K+1) ms", "T(K+1) / forward(1)", "draft ms", "verify ms",
                   "commit ms", "rest ms", "bound", "speedup", "efficiency"]
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        for name, c in self.cases.items():
            b = c.breakdown
            if b is None:
                continue
            eff = "-" if b.efficiency is None else f"{b.efficiency:.2f}"
            ratio = b.tk1_ms / b.forward_1_ms if b.forward_1_ms else float("nan")
            lines.append(f"| {name} | {b.compression:.2f} | {b.t1_ms:.2f} | {b.tk1_ms:.2f} | {ratio:.2f} | {b.draft_ms:.2f} | "
                         f"{b.verify_ms:.2f} | {b.commit_ms:.2f} | {b.rest_ms:.2f} | {b.bound:.2f}x | "
                         f"{c.speedup:.2f}x | {eff} |")
        return "\n".join(lines) + "\n"

    def to_markdown(self) -> str:
        """A markdown table: one row per case, plus a line with the run's settings."""
        quality_keys = sorted({k for c in self.cases.values() for k in c.quality})
        unit = next(iter(self.cases.values())).unit if self.cases else "items"
        headers = ["method", "median s", "spread (IQR) s", "speedup", f"{unit}/s", "mean acc. len",
                   "step compression", "efficiency", "peak mem MiB"] + quality_keys
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]

        def fmt(value: Any, spec: str) -> str:
            return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

        for name, c in self.cases.items():
            label = f"{name} (baseline)" if name == self.baseline else name
            peak = None if c.peak_memory_bytes is None else c.peak_memory_bytes / 2**20
            row = [label, fmt(c.median_s, ".4f"), fmt(c.iqr_s, ".4f"), fmt(c.speedup, ".2f") + ("x" if c.speedup else ""),
                   fmt(c.items_per_s, ".1f"), fmt(c.mean_accepted_length, ".2f"), fmt(c.ideal_speedup, ".2f"),
                   fmt(c.breakdown.efficiency if c.breakdown else None, ".2f"), fmt(peak, ".1f")] + [fmt(c.quality.get(k), ".4g") for k in quality_keys]
            lines.append("| " + " | ".join(row) + " |")
        m = self.meta
        lines.append("")
        lines.append(
            f"{m['repeats']} timed repeats after {m['warmup']} warm-up call(s) per case, seed {m['seed']}, "
            f"device {m['device']}, torch {m['torch']}, {m['threads']} thread(s); memory: {m['memory_source']}."
        )
        if self.load is not None:
            lines.append(f"Machine load during the timed repeats: {self.load.describe()}.")
        return "\n".join(lines) + "\n"

    def plot(self, path: str | Path, quality_key: str | None = None, title: str | None = None) -> Path:
        """Save a figure: speedup vs ``quality_key`` (scatter), or a bar chart of speedups without one."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(self.cases)
        speedups = [self.cases[n].speedup or float("nan") for n in names]
        fig, ax = plt.subplots(figsize=(5.5, 4))
        if quality_key is not None:
            missing = [n for n in names if quality_key not in self.cases[n].quality]
            if missing:
                plt.close(fig)
                raise ValueError(f"quality_key: {quality_key!r} is missing from the cases {missing}")
            quality = [self.cases[n].quality[quality_key] for n in names]
            ax.scatter(speedups, quality)
            for n, x, y in zip(names, speedups, quality):
                ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            ax.set_xlabel(f"speedup over {self.baseline} (x)")
            ax.set_ylabel(quality_key)
            ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        else:
            ax.bar(names, speedups)
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_ylabel(f"speedup over {self.baseline} (x)")
            ax.tick_params(axis="x", rotation=30)
        ax.set_title(title or f"{self.meta['device']}, median of {self.meta['repeats']} repeats")
        fig.tight_layout()
        path = Path(path)
        suffix = path.suffix.lstrip(".") or "png"
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=suffix, dpi=120)
        plt.close(fig)
        return path


# ----------------------------------------------------------------------------------------------
# Measurement helpers
# ----------------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    """Reseed python, numpy and torch (CPU and CUDA) so every case sees the same random state."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _cuda_active() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _sync() -> None:
    if _cuda_active():
        torch.cuda.synchronize()


def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class MemoryProbe:
    """Peak memory of one call: CUDA allocator peak, else the RSS high-water mark, else ru_maxrss."""

    def __init__(self, device: str):
        self.device = device
        self.can_reset_rss = False
        if device == "cpu" and sys.platform.startswith("linux"):
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                self.can_reset_rss = _proc_status_kib("VmHWM") is not None
            except OSError:
                self.can_reset_rss = False

    @property
    def source(self) -> str:
        if self.device != "cpu":
            return "torch.cuda.max_memory_allocated (reset per call)"
        if self.can_reset_rss:
            return "process peak RSS during the call (VmHWM, reset per call)"
        return "ru_maxrss (process lifetime peak; not resettable on this OS)"

    def start(self) -> int | None:
        if self.device != "cpu":
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        if self.can_reset_rss:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            rss = _proc_status_kib("VmRSS")
            return None if rss is None else rss * 1024
        return None

    def stop(self) -> int | None:
        if self.device != "cpu":
            return int(torch.cuda.max_memory_allocated())
        if self.can_reset_rss:
            hwm = _proc_status_kib("VmHWM")
            return None if hwm is None else hwm * 1024
        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)


def _stats_dict(stats: Any) -> dict[str, Any] | None:
    if stats is None:
        return None
    for attr in ("as_dict", "to_dict"):
        fn = getattr(stats, attr, None)
        if callable(fn):
            try:
                return dict(fn())
            except Exception:  # a statistics object that cannot serialise itself is not fatal
                break
    out = {}
    for name in ("mean_accepted_length", "tokens", "target_calls", "draft_calls"):
        value = getattr(stats, name, None)
        if isinstance(value, (int, float)):
            out[name] = value
    return out


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


# ----------------------------------------------------------------------------------------------
# The harness
# ----------------------------------------------------------------------------------------------


def run_benchmark(
    cases: Mapping[str, Callable[[], Any]],
    baseline: str = "none",
    warmup: int = 1,
    repeats: int = 3,
    seed: int = 0,
    device: str | None = None,
    unit: str = "tokens",
    trace_python_memory: bool = False,
    progress: bool = False,
) -> BenchmarkReport:
    """Time every case in one process with the same seeds; see the module docstring.

    Args:
        cases: name -> zero-argument callable. The callable closes over its inputs (same prompts for
            every case) and returns a :class:`RunResult` (or see :func:`as_run_result`).
        baseline: the case speedups are measured against (must be in ``cases``).
        warmup: untimed calls per case before timing (compilation, caches, allocator warm-up).
        repeats: timed calls per case; the report gives their median and spread.
        seed: every call starts from ``seed_everything(seed)``.
        device: "cpu" or "cuda" for the memory probe; default: "cuda" if CUDA is initialised.
        unit: item name used when a case returns a bare count.
        trace_python_memory: one extra untimed call per case under tracemalloc.
        progress: show a tqdm bar over the calls.
    """
    if not cases:
        raise ValueError("cases: give at least one case")
    if baseline not in cases:
        raise ValueError(f"baseline: {baseline!r} is not one of the cases {list(cases)}")
    if not all(callable(fn) for fn in cases.values()):
        raise ValueError("cases: every value must be a zero-argument callable")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    device = device or ("cuda" if _cuda_active() else "cpu")
    device = "cpu" if device == "cpu" else "cuda"
    probe = MemoryProbe(device)
    # Baseline first, then the others in the given order.
    names = [baseline] + [n for n in cases if n != baseline]

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(names) * (warmup + repeats + int(trace_python_memory)), desc="benchmark", unit="call")

    def call(name: str) -> RunResult:
        seed_everything(seed)
        result = as_run_result(cases[name](), unit)
        if bar is not None:
            bar.update(1)
        return result

    for name in names:
        for _ in range(warmup):
            call(name)

    python_peaks: dict[str, int] = {}
    if trace_python_memory:
        for name in names:
            gc.collect()
            tracemalloc.start()
            try:
                call(name)
                python_peaks[name] = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()

    monitor = LoadMonitor()
    times: dict[str, list[float]] = {n: [] for n in names}
    results: dict[str, list[RunResult]] = {n: [] for n in names}
    peaks: dict[str, list[int]] = {n: [] for n in names}
    increases: dict[str, list[int]] = {n: [] for n in names}
    for _ in range(repeats):
        for name in names:
            gc.collect()
            _sync()
            before = probe.start()
            start = time.perf_counter()
            result = call(name)
            _sync()
            elapsed = time.perf_counter() - start
            peak = probe.stop()
            if result.wall_time is not None:
                if not result.wall_time >= 0:
                    raise ValueError(f"case {name!r} returned wall_time={result.wall_time}")
                elapsed = float(result.wall_time)
            times[name].append(elapsed)
            results[name].append(result)
            if peak is not None:
                peaks[name].append(peak)
                if before is not None:
                    increases[name].append(max(peak - before, 0))
    load = monitor.stop()
    if bar is not None:
        bar.close()

    reports: dict[str, CaseReport] = {}
    for name in names:
        last = results[name][-1]
        counts = {r.num_items for r in results[name]}
        if len(counts) > 1:
            # Same seeds should give the same output length; report the median and keep going.
            num_items = int(statistics.median(r.num_items for r in results[name]))
        else:
            num_items = last.num_items
        median = statistics.median(times[name])
        q1, q3 = _quartiles(times[name])
        accepted = [getattr(r.stats, "mean_accepted_length", None) for r in results[name]]
        accepted = [float(a) for a in accepted if isinstance(a, (int, float))]
        tok = getattr(last.stats, "tokens", None)
        calls = getattr(last.stats, "target_calls", None)
        quality: dict[str, float] = {}
        for r in results[name]:
            quality.update(r.quality or {})
        reports[name] = CaseReport(
            name=name,
            unit=last.unit,
            num_items=num_items,
            times=times[name],
            median_s=median,
            min_s=min(times[name]),
            max_s=max(times[name]),
            iqr_s=q3 - q1,
            items_per_s=num_items / median if median > 0 else float("inf"),
            mean_accepted_length=statistics.median(accepted) if accepted else None,
            tokens_per_target_call=(tok / calls) if isinstance(tok, (int, float)) and isinstance(calls, (int, float)) and calls else None,
            peak_memory_bytes=max(peaks[name]) if peaks[name] else None,
            peak_memory_increase_bytes=max(increases[name]) if increases[name] else None,
            python_peak_bytes=python_peaks.get(name),
            quality=quality,
            stats=_stats_dict(last.stats),
        )
    base = reports[baseline]
    for c in reports.values():
        c.speedup = base.median_s / c.median_s if c.median_s > 0 else float("inf")
        paired = [b / t for b, t in zip(base.times, c.times) if t > 0]
        c.paired_speedup_range = (min(paired), max(paired)) if paired else None
        c.paired_speedup_median = statistics.median(paired) if paired else None
        if c.tokens_per_target_call and base.tokens_per_target_call:
            c.ideal_speedup = c.tokens_per_target_call / base.tokens_per_target_call
        if c is not base:
            c.breakdown = median_breakdown([(_stats_dict(case.stats), _stats_dict(b.stats), t_case, t_base)
                                            for case, b, t_case, t_base in zip(results[c.name], results[baseline],
                                                                               times[c.name], times[baseline])],
                                           c.ideal_speedup)

    meta = {
        "warmup": warmup,
        "repeats": repeats,
        "seed": seed,
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "memory_source": probe.source,
        "order": "warm-up per case, then round-robin repeats: " + ", ".join(names),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "load": asdict(load),
    }
    return BenchmarkReport(cases=reports, baseline=baseline, meta=meta)
