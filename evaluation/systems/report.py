"""The systems benchmark's outputs: one markdown table per architecture, the JSON payload, a plot.

Token rows (AR images, VLMs) and block rows (CSpD, SDVG) have different columns (:mod:`.token_rows`,
:mod:`.block_rows`); both end with the speedup, its bound and the efficiency, the loop's own time and the
peak memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .specs import TOKEN_FAMILIES


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _speedup(row: Mapping[str, Any]) -> str:
    low, high = row["speedup_range"]
    spread = f" [{low:.2f}-{high:.2f}]" if high - low >= 0.005 else ""
    return f"{row['speedup']:.2f}{spread}"


def _table(header: Sequence[str], rows: Sequence[Mapping[str, Any]],
           cells: Callable[[Mapping[str, Any]], Sequence[str]]) -> list[str]:
    """A markdown table: ``header``, its rule, and one line of ``cells(row)`` per row."""
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cells(r)) + " |" for r in rows])


def _depth(row: Mapping[str, Any]) -> str:
    """K, and a tree's node count (its verification forward runs nodes + 1 tokens, the T(K+1) column)."""
    nodes = row.get("nodes", row["K"])
    return str(row["K"]) if nodes == row["K"] else f"{row['K']} ({nodes} nodes)"


def token_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per token-method row: acceptance, timings, speedup against the bound, loop overhead."""
    header = ["method", "alpha", "batch", "K", "tau (expected)", "T(1) ms", "T(K+1) ms", "draft ms/token",
              "speedup [range]", "bound", "efficiency", "loop ms/round (% of T(K+1))", "target-only loop ms/step",
              "peak MB"]
    return _table(header, rows, lambda r: [
        str(r["method"]), str(r["alpha"]), str(r["batch"]), _depth(r),
        f"{_num(r['tau'])} ({_num(r['tau_expected'])})", _num(r["t1_ms"], 1), _num(r["tk1_ms"], 1),
        _num(r["draft_ms"], 2), _speedup(r), _num(r["bound"]), _num(r["efficiency"]),
        f"{_num(r['loop_ms'], 2)} ({_num(r['loop_pct'], 1)} %)", _num(r["base_loop_ms"], 2), _num(r["peak_mb"], 0)])


def block_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per block-method row (continuous and video): acceptance, target passes, speedup, bound."""
    header = ["method", "alpha", "batch", "accepted", "target passes (target-only)", "speedup [range]", "bound",
              "efficiency", "loop ms/pass (% of a pass)", "peak MB"]
    return _table(header, rows, lambda r: [
        str(r["method"]), _num(r["alpha"]), str(r["batch"]), _num(r["acceptance"]),
        f"{r['target_passes']} ({r['base_target_passes']})", _speedup(r), _num(r["bound"]), _num(r["efficiency"]),
        f"{_num(r['loop_ms'], 2)} ({_num(r['loop_pct'], 1)} %)", _num(r["peak_mb"], 0)])


def system_section(result: Mapping[str, Any]) -> list[str]:
    """The heading, the sizes and the table of one architecture's result."""
    spec = result["spec"]
    params = ", ".join(f"{name} {count:.3g}M" for name, count in result["params_m"].items())
    load = result.get("load")
    lines = [f"### {spec['name']} ({spec['family']})", "",
             f"{spec['source']}. Parameters: {params}. Built in {result['build_s']:.0f} s"
             + (f"; load average {load[0]:.1f} -> {load[1]:.1f} over its rows" if load else "") + "."]
    lines += [f"{note}." for note in spec.get("notes", ())]
    tokens = f", {result['new_tokens']} new tokens per row" if spec["family"] in TOKEN_FAMILIES else ""
    lines += ["", f"Guidance {spec['guidance_scale']}{tokens}; settings per method: "
              + "; ".join(f"{name} `{config}`" for name, config in result["configs"].items()) + ".", ""]
    table = token_table if spec["family"] in TOKEN_FAMILIES else block_table
    return lines + table(result["rows"]) + [""] + profile_lines(result["rows"])


def profile_lines(rows: Sequence[Mapping[str, Any]], count: int = 5) -> list[str]:
    """For each profiled row, the package's own functions that took the most time (``--profile``)."""
    lines = []
    for row in rows:
        profile = row.get("profile")
        if not profile:
            continue
        entries = profile.get("core", []) if isinstance(profile, Mapping) else profile
        shown = ", ".join(f"`{e['function']}` {e['own_ms']:.0f} ms ({e['calls']} calls)" for e in entries[:count])
        lines.append(f"* Profile, {row['method']} alpha {row['alpha']} batch {row['batch']}: {shown}.")
    return lines + [""] if lines else []


def to_markdown(results: Sequence[Mapping[str, Any]], command: str, machine: str, state: str) -> str:
    """The report: the command, where it ran, then one section per architecture."""
    lines = ["## Systems benchmark", "", f"`{command}`", "", f"Machine: {machine}. {state}", ""]
    for result in results:
        lines += system_section(result)
    return "\n".join(lines)


def plot(results: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Speedup (solid) and bound (dashed) against alpha, per architecture and method at its smallest batch;
    None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shown = [r for r in results if any(row.get("alpha") is not None for row in r["rows"])]
    if not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(4.5 * len(shown), 3.6), squeeze=False)
    for ax, result in zip(axes[0], shown):
        batch = min(row["batch"] for row in result["rows"])
        for method in dict.fromkeys(row["method"] for row in result["rows"]):
            points = sorted((row["alpha"], row["speedup"], row["bound"]) for row in result["rows"]
                            if row["method"] == method and row["batch"] == batch and row["alpha"] is not None)
            if not points:
                continue
            alphas, speedups, bounds = zip(*points)
            line, = ax.plot(alphas, speedups, marker="o", label=method)
            if all(b is not None for b in bounds):
                ax.plot(alphas, bounds, linestyle="--", marker="x", color=line.get_color())
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set_title(f"{result['spec']['name']} (batch {batch})")
        ax.set_xlabel("alpha")
        ax.set_ylabel("speedup (x, dashed: bound)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
