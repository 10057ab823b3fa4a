"""Benchmark of ARVideoPipeline on one zoo entry: SDVG with the checkpoint's stored settings and a tau sweep
of reference settings against target-only and draft-only generation, speed and quality measured in one run.

Cases: ``none`` (the target, the baseline), ``draft`` (``method="draft"``: the drafter alone with its stored
settings, the quality floor), ``sdvg`` (``method="sdvg"`` and nothing else: the settings stored with the
checkpoint, ``speculation_config.json``, what a user's plain call gets) and one ``sdvg ... (reference)`` case
per ``--sweep`` item ``reward:tau[:mean][:refine=T]`` (an explicit :class:`~mmspec.methods.sdvg.SDVGConfig`:
worst-frame aggregation unless ``mean``; first block forced to the target; rejected blocks regenerated from
noise unless ``refine=T``: the target refines the rejected draft from its timestep T,
``refine_rejected_from``; rewards: the shapes world's exact per-frame score ``fraction``, its finer ``match``
variant, or ``imagereward`` with local weights; the drafter samples as ``--draft-steps`` /
``--draft-guidance-scale`` say, by default as the folder's ``model_index.json`` does). Every case shares the
call's own settings (``--steps``, ``--sampler``, ``--guidance-scale``). For every case:

* **quality** on ``--quality-prompts`` prompts of ``make_video_prompt_set`` (one video each, seed
  ``seed + i`` for prompt i in every case, so the cases are paired): the shapes world's exact evaluator
  (``evaluate_videos``: mean per-frame score, clip accuracy = identity and motion correct), and the mean
  per-frame ImageReward when its local weights are given (``--imagereward-*``); plus the routing
  record (fraction of drafted blocks accepted, target and drafter passes per video);
* **speed** with :func:`~mmspec.evaluation.speed.run_benchmark`: ``--speed-prompts`` other prompts, one
  video at a time (batch 1, as SDVG is described), warm-up, round-robin timed repeats, median.

    python -m mmspec.evaluation.bench_video --out docs/benchmarks/video_cpu.md

writes the markdown table (with this command line), a ``.json`` with every number and a ``.png``
speed-quality plot beside it.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmspec.methods.sdvg import SDVGConfig
from mmspec.reward import aggregate_frame_rewards
from mmspec.world import evaluate_videos, make_video_prompt_set

from .bench_cli import (
    add_run_arguments,
    command_line,
    load_quiet_pipeline,
    machine_line,
    new_parser,
    write_report,
)
from .files import atomic_path
from .speed import LoadMonitor, RunResult, run_benchmark

GOAL_SPEEDUP, GOAL_QUALITY = 1.5, 0.98
#: the case of SDVG with the checkpoint's stored settings (``method="sdvg"``, nothing else)
STORED_CASE = "sdvg"
REFERENCE = " (reference)"


@dataclass(frozen=True)
class SweepItem:
    """One SDVG case of the sweep: reward name, tau, aggregation, and the target's timestep for refining a
    rejected draft (None: regenerate it from noise, SDVG's rule)."""

    reward: str
    tau: float
    aggregate: str = "min"
    refine: float | None = None

    @property
    def case_name(self) -> str:
        return (f"sdvg {self.reward} tau={self.tau:g}" + ("" if self.aggregate == "min" else f" {self.aggregate}")
                + ("" if self.refine is None else f" refine={self.refine:g}") + REFERENCE)

    def config(self, reward: Any, draft_steps: int | None = None, draft_guidance_scale: float | None = None
               ) -> SDVGConfig:
        """The reference case's explicit config (``reward``: the callable scoring the item's reward)."""
        return SDVGConfig(tau=self.tau, reward=reward, aggregate=self.aggregate, refine_rejected_from=self.refine,
                          draft_num_inference_steps=draft_steps, draft_guidance_scale=draft_guidance_scale)


def stored_item(config: SDVGConfig) -> SweepItem:
    """The stored SDVG settings as a table row's reward, tau, aggregate and refinement (a "shapes" reward is
    named by its mode, as the sweep names it)."""
    reward = config.reward if isinstance(config.reward, str) else getattr(config.reward, "__name__", "callable")
    if reward == "shapes":
        reward = dict(config.reward_kwargs or {}).get("mode", "fraction")
    return SweepItem(reward, float(config.tau), config.aggregate, config.refine_rejected_from)


def case_kwargs(method: Any, common: dict) -> dict:
    """Pipeline arguments of a case: ``method`` (a name: the stored settings; or a config) with ``common``."""
    return {"method": method, **common}


def generate(pipe: Any, prompts: Sequence[Any], kwargs: dict, seed: int) -> tuple[np.ndarray, list[Any]]:
    """One video per prompt (batch 1, generator seeded ``seed + i``): frames uint8 ``[N, F, H, W, 3]``, stats."""
    videos, stats = [], []
    for i, prompt in enumerate(prompts):
        out = pipe(prompt.text, generator=torch.Generator().manual_seed(seed + i), output_type="np", **kwargs)
        videos.append((np.clip(out.frames[0], 0, 1) * 255 + 0.5).astype(np.uint8))
        stats.append(out.stats)
    return np.stack(videos), stats


def routing_summary(stats: Sequence[Any]) -> dict[str, float]:
    accepted = torch.cat([s.accepted.flatten() for s in stats])
    routed = torch.cat([s.routed.flatten() for s in stats])
    return {
        "acceptance": float(accepted[routed].float().mean()) if routed.any() else float("nan"),
        "draft_fraction": float(accepted.float().mean()),
        "target_calls": float(np.mean([s.target_calls for s in stats])),
        "draft_calls": float(np.mean([s.draft_calls for s in stats])),
        "reward_calls": float(np.mean([s.reward_calls for s in stats])),
    }


def block_rewards_after_first_block(reward: Any, videos: np.ndarray, prompts: Sequence[Any],
                                    frames_per_block: int, aggregate: str = "min") -> torch.Tensor:
    """Each block's aggregated reward ``[N, blocks - 1]`` (worst frame, or the mean with ``aggregate="mean"``)
    for the blocks after the first in ``videos`` (uint8 ``[N, F, H, W, 3]``): what SDVG's router compares
    with tau."""
    rewards = [torch.as_tensor(reward(video[frames_per_block:], prompt.text), dtype=torch.float64)
               for video, prompt in zip(videos, prompts)]
    return aggregate_frame_rewards(torch.stack(rewards).unflatten(1, (-1, frames_per_block)), aggregate)


def own_block_pass_rate(reward: Any, tau: float, videos: np.ndarray, prompts: Sequence[Any],
                        frames_per_block: int, aggregate: str = "min") -> float:
    """Share of the blocks after the first in ``videos`` whose aggregated reward is ``>= tau``: for
    target-only videos, how often SDVG's router would keep a block that the target drew itself, the
    acceptance a drafter as good as the target would get (the ceiling for this target, reward and tau); for
    draft-only videos, the drafter's blocks in its own context."""
    return pass_rate(block_rewards_after_first_block(reward, videos, prompts, frames_per_block, aggregate), tau)


def pass_rate(block_rewards: torch.Tensor, tau: float) -> float:
    """Share of blocks whose aggregated reward reaches ``tau`` (the router's decision, per block)."""
    return float((block_rewards >= tau).double().mean())


def imagereward_of(scorer: Any, videos: np.ndarray, prompts: Sequence[Any]) -> float:
    """Mean per-frame ImageReward (frames upscaled to 224 by nearest neighbour)."""
    import PIL.Image

    scores = []
    for video, prompt in zip(videos, prompts):
        images = [PIL.Image.fromarray(f).resize((224, 224), PIL.Image.NEAREST) for f in video]
        scores += scorer.score(images, [prompt.text] * len(images))
    return float(np.mean(scores))


def run(pipe: Any, cases: dict[str, dict], quality_prompts: Sequence[Any], speed_prompts: Sequence[Any],
        repeats: int, seed: int, imagereward: Any = None, log=print, routers: dict[str, tuple] | None = None) -> dict:
    """Every measurement of the table; returns a JSON-able dict. ``routers``: per SDVG case its reward callable,
    tau and aggregate (for the pass rates of the target's and the drafter's own blocks)."""
    routers = routers or {}
    quality: dict[str, dict[str, float]] = {}
    own_videos: dict[str, np.ndarray] = {}  # target-only and draft-only videos, for the routers' pass rates
    block_rewards: dict[tuple[int, str, str], torch.Tensor] = {}  # (reward, aggregate, video set), shared by taus
    for name, kwargs in cases.items():
        start = time.perf_counter()
        videos, stats = generate(pipe, quality_prompts, kwargs, seed)
        result = evaluate_videos(list(videos), list(quality_prompts))
        q = {"frame_score": result.frame_score, "accuracy": result.accuracy, "identity": result.identity,
             "motion": result.motion, **routing_summary(stats)}
        if name in ("none", "draft"):
            own_videos[name] = videos
        elif name in routers and set(own_videos) == {"none", "draft"}:
            reward, tau, aggregate = routers[name]
            for method, key in (("none", "target_blocks_pass"), ("draft", "draft_blocks_pass")):
                scored = (id(reward), aggregate, method)
                if scored not in block_rewards:
                    block_rewards[scored] = block_rewards_after_first_block(
                        reward, own_videos[method], quality_prompts, pipe.frames_per_block, aggregate)
                q[key] = pass_rate(block_rewards[scored], tau)
        q["seconds"] = time.perf_counter() - start
        if imagereward is not None:
            q["imagereward"] = imagereward_of(imagereward, videos, quality_prompts)
        quality[name] = q
        log(f"quality {name}: " + ", ".join(f"{k}={v:.4g}" for k, v in q.items()))

    def speed_case(kwargs: dict):
        def call() -> RunResult:
            videos, stats = generate(pipe, speed_prompts, kwargs, seed + 100_000)
            return RunResult(num_items=len(videos), unit="videos")
        return call

    report = run_benchmark({name: speed_case(kwargs) for name, kwargs in cases.items()}, baseline="none",
                           warmup=1, repeats=repeats, seed=seed, unit="videos")
    log(report.to_markdown())
    speed = {name: {"speedup": c.speedup, "paired_speedup_median": c.paired_speedup_median,
                    "paired_speedup_range": c.paired_speedup_range, "median_s": c.median_s, "iqr_s": c.iqr_s,
                    "videos_per_s": c.items_per_s}
             for name, c in report.cases.items()}
    return {"quality": quality, "speed": speed, "benchmark": report.to_dict()}


def conservative_speedup(speed: dict) -> float:
    """The lower of a case's two speedup estimates: the ratio of the median times and the median of the
    per-pass ratios (result files written before the paired median was recorded: the first alone)."""
    paired = speed.get("paired_speedup_median")
    return speed["speedup"] if paired is None else min(speed["speedup"], paired)


def best_tau(results: dict) -> tuple[str | None, str]:
    """The fastest sdvg case meeting both goals, and a sentence saying whether the goals were met (when not:
    the fastest case that keeps the quality, its speedup to three decimals, since the table rounds to two).
    Speed counts by :func:`conservative_speedup`, so one slow pass of the baseline cannot carry a case over
    the line."""
    none = results["quality"]["none"]["frame_score"]
    draft = results["quality"]["draft"]["frame_score"]
    keeps_quality = [n for n in results["quality"] if n.startswith("sdvg")
                     and results["quality"][n]["frame_score"] >= GOAL_QUALITY * none
                     and results["quality"][n]["frame_score"] > draft]
    speed = {n: conservative_speedup(results["speed"][n]) for n in keeps_quality}
    met = [n for n in keeps_quality if speed[n] >= GOAL_SPEEDUP]
    if not met:
        sentence = (f"**Goal not met in this run**: no tau reached >= {GOAL_SPEEDUP}x at >= {GOAL_QUALITY:.0%} of "
                    f"the target's per-frame score ({none:.3f}) while staying above draft-only ({draft:.3f}).")
        if keeps_quality:
            closest = max(keeps_quality, key=speed.get)
            q = results["quality"][closest]
            sentence += (f" Fastest at that quality: {closest}, {speed[closest]:.3f}x at "
                         f"{_ratio(q['frame_score'], none):.1%}.")
        return None, sentence
    best = max(met, key=speed.get)
    q = results["quality"][best]
    return best, (f"**Goal met**: {best} runs {speed[best]:.2f}x faster than the target alone (the lower of the "
                  f"ratio of the medians and the median paired ratio) at {_ratio(q['frame_score'], none):.1%} of its "
                  f"per-frame score ({q['frame_score']:.3f} vs {none:.3f}; draft-only {draft:.3f}).")


def stored_sentence(results: dict) -> str:
    """Whether the stored settings (``method="sdvg"``) meet both goals, with their speed and quality."""
    if STORED_CASE not in results["quality"]:
        return ""
    none = results["quality"]["none"]["frame_score"]
    draft = results["quality"]["draft"]["frame_score"]
    q, speed = results["quality"][STORED_CASE], conservative_speedup(results["speed"][STORED_CASE])
    met = speed >= GOAL_SPEEDUP and q["frame_score"] >= GOAL_QUALITY * none and q["frame_score"] > draft
    return (f"**Stored settings** (`method=\"sdvg\"`, nothing else): {speed:.2f}x (the lower of the two estimates) at "
            f"{_ratio(q['frame_score'], none):.1%} of the target's per-frame score ({q['frame_score']:.3f} vs "
            f"{none:.3f}; draft-only {draft:.3f}): goal {'met' if met else 'not met'} (>= {GOAL_SPEEDUP}x at >= "
            f"{GOAL_QUALITY:.0%}, above draft-only).")


def _method_cell(name: str) -> str:
    """The table's method column: the stored-settings case and reference cases labelled as such."""
    if name == STORED_CASE:
        return "sdvg (stored settings)"
    return "sdvg (reference)" if name.endswith(REFERENCE) else name.split(" ")[0]


def _paired_cell(speed: dict) -> str:
    """``"1.56x (1.51-1.73)"``: the median and range of the per-pass speedups ("-" where not recorded)."""
    median, spread = speed.get("paired_speedup_median"), speed.get("paired_speedup_range")
    if median is None or spread is None:
        return "-"
    return f"{median:.2f}x ({spread[0]:.2f}-{spread[1]:.2f})"


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _guidance(results: dict) -> str:
    """The guidance of a run (older result files have none: 1)."""
    target, draft = results.get("guidance_scale", 1.0), results.get("draft_guidance_scale")
    return f"{target:g}" if draft is None or draft == target else f"{target:g} (drafter {draft:g})"


def _draft_steps(results: dict) -> str:
    """`` (drafter: N)`` when the drafter sampled with fewer steps than the target; the reference rows' drafter
    sampling when it differs from the stored one."""
    steps = results.get("draft_steps")
    text = "" if steps is None or steps == results["steps"] else f" (drafter: {steps})"
    reference = results.get("reference_draft_steps"), results.get("reference_draft_guidance_scale")
    if "reference_draft_steps" in results and reference != (steps, results.get("draft_guidance_scale")):
        ref_steps = results["steps"] if reference[0] is None else reference[0]
        ref_scale = results.get("guidance_scale", 1.0) if reference[1] is None else reference[1]
        text += f" (reference rows' drafter: {ref_steps} steps, guidance {ref_scale:g})"
    return text


def to_markdown(results: dict, command: str) -> str:
    none_q, draft_q = results["quality"]["none"], results["quality"]["draft"]
    has_ir = "imagereward" in none_q
    lines = [f"Command: `{command}`", "",
             f"Machine: {results['machine']}. Quality: {results['quality_prompts']} prompts of "
             f"`make_video_prompt_set` (one video each, same seeds in every case); speed: "
             f"{results['speed_prompts']} other prompts per timed call, batch 1, {results['repeats']} timed repeats "
             "after a warm-up (round-robin: each pass times every case once; `speedup` = the baseline's median "
             "time over the case's, `paired speedup` = the per-pass ratios). "
             f"Videos of {results['frames']} frames "
             f"({results['blocks']} blocks of {results['frames_per_block']}), {results['steps']} denoising steps per "
             f"block{_draft_steps(results)} ({results['sampler']} sampler), guidance {_guidance(results)}; target "
             f"{results['target_layers']} layers, drafter {results['drafter_layers']}. `draft` and `sdvg (stored "
             "settings)` are calls with `method=\"draft\"` / `method=\"sdvg\"` and nothing else (the checkpoint's "
             "`speculation_config.json`); `sdvg (reference)` rows are explicit `SDVGConfig`s of the tau sweep. SDVG: "
             "worst frame (`mean`: the block's mean frame), first block forced to the target, rejected blocks "
             "regenerated by the target from their noise (`refined from T`: the target refines the rejected draft "
             "from its timestep T, `refine_rejected_from`); rewards: "
             "`fraction` = the exact per-frame score (fraction of the prompted objects found), `match` = the same "
             "with each found object weighted by its template-match quality (0.6-1).", "",
             "| method | reward | tau | rejected blocks | speedup | paired speedup: median (range) | "
             "accepted (routed blocks) | target's own blocks pass | "
             "draft-only blocks pass | draft blocks | target passes / video | "
             "drafter passes / video | per-frame score | vs target | vs draft | clip accuracy |"
             + (" ImageReward |" if has_ir else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if has_ir else "")]
    for name, q in results["quality"].items():
        s = results["speed"][name]
        item = results["sweep_items"].get(name)
        reward, tau, rejected = ("-", "-", "-") if item is None else (
            item["reward"] + ("" if item["aggregate"] == "min" else f" {item['aggregate']}"), f"{item['tau']:g}",
            "from noise" if item["refine"] is None else f"refined from {item['refine']:g}")
        acc = "-" if math.isnan(q["acceptance"]) else f"{q['acceptance']:.2f}"
        own = [f"{q[key]:.2f}" if key in q else "-" for key in ("target_blocks_pass", "draft_blocks_pass")]
        row = (f"| {_method_cell(name)} | {reward} | {tau} | {rejected} | {s['speedup']:.2f}x | {_paired_cell(s)} | "
               f"{acc} | {own[0]} | {own[1]} | "
               f"{q['draft_fraction']:.2f} | "
               f"{q['target_calls']:.1f} | {q['draft_calls']:.1f} | {q['frame_score']:.3f} | "
               f"{_ratio(q['frame_score'], none_q['frame_score']):.1%} | {q['frame_score'] - draft_q['frame_score']:+.3f} | "
               f"{q['accuracy']:.3f} |")
        if has_ir:
            row += f" {q['imagereward']:.3f} |"
        lines.append(row)
    lines += ["", stored_sentence(results), "", best_tau(results)[1], "",
              "`target's own blocks pass` / `draft-only blocks pass`: the share of the target-only / draft-only "
              "videos' blocks after the first that the row's router (same reward, tau, worst frame) would keep; the "
              "first is the acceptance a drafter exactly as good as the target would get, the ceiling of this "
              "target for the row's reward and tau.", "",
              "Passes count model calls: the prompt's, then denoising steps; blocks are written into a model's "
              "cache at t=0 by its next denoising pass (`pending_clean`), not by passes of their own, so a run of "
              "accepted blocks costs the target a few tokens more in its next pass. `vs draft` is the "
              "per-frame score minus draft-only's. CPU caveat: at these sizes a forward "
              "costs roughly the same for any number of new tokens and per-call overheads weigh more than on a "
              "GPU, so the drafter's relative cost and the reward's (the exact evaluator parses every drafted "
              "frame, about 1 ms per frame) are higher here than in the paper's setting.", ""]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    names = list(results["quality"])
    xs = [results["speed"][n]["speedup"] for n in names]
    ys = [results["quality"][n]["frame_score"] for n in names]
    refines = {n: item["refine"] for n, item in results["sweep_items"].items() if n != STORED_CASE}
    for refine in dict.fromkeys(refines.values()):
        sdvg = [i for i, n in enumerate(names) if n in refines and refines[n] == refine]
        label = "SDVG (reference tau sweep)" if refine is None else f"SDVG (reference), refined from {refine:g}"
        ax.plot([xs[i] for i in sdvg], [ys[i] for i in sdvg], "o", label=label)
    for i, n in enumerate(names):
        if n in ("none", "draft"):
            ax.plot(xs[i], ys[i], "s", label={"none": "target only", "draft": "draft only"}[n])
        elif n == STORED_CASE:
            ax.plot(xs[i], ys[i], "*", markersize=11, label="SDVG, stored settings")
        label = n.replace("sdvg ", "").replace("tau=", "").replace(REFERENCE, "")
        ax.annotate(label, (xs[i], ys[i]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    none = results["quality"]["none"]["frame_score"]
    ax.axhline(GOAL_QUALITY * none, color="grey", ls="--", lw=0.8, label=f"{GOAL_QUALITY:.0%} of target")
    ax.axvline(GOAL_SPEEDUP, color="grey", ls=":", lw=0.8, label=f"{GOAL_SPEEDUP}x")
    ax.set_xlabel("speedup over target-only (x)")
    ax.set_ylabel("per-frame score (shapes evaluator)")
    ax.set_title(f"ARVideoPipeline, shapes-video, {results['machine'].split(',')[0]}", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    return path


REWARD_MODES = {"fraction": "fraction", "match": "match"}
DEFAULT_SWEEP = ["match:0.1", "match:0.5", "match:0.9", "fraction:1", "match:0.3:mean", "match:0.4:mean",
                 "match:0.1:refine=750", "match:0.5:refine=750", "match:0.3:mean:refine=750", "match:0.1:refine=500"]


def parse_sweep(items: Sequence[str]) -> list[SweepItem]:
    """``"reward:tau[:min|mean][:refine=T]"`` strings -> :class:`SweepItem`; reward is a shapes mode or
    "imagereward", the aggregate "min" (worst frame, the default) or "mean", ``refine=T`` the target's
    timestep to refine rejected drafts from (default: regenerate them from noise)."""
    usage = (f"--sweep items are reward:tau[:min|mean][:refine=T] with reward in {[*REWARD_MODES, 'imagereward']}, "
             "e.g. match:0.3:mean or match:0.1:refine=750")
    parsed = []
    for item in items:
        name, _, rest = item.partition(":")
        value, *options = rest.split(":")
        if name not in (*REWARD_MODES, "imagereward") or not value or len(options) > 2:
            raise SystemExit(f"{usage}; got {item!r}")
        aggregate, refine = "min", None
        for option in options:
            if option in ("min", "mean"):
                aggregate = option
            elif option.startswith("refine="):
                refine = _sweep_number(option.removeprefix("refine="), "refine timestep", item)
            else:
                raise SystemExit(f"{usage}; got {item!r}")
        parsed.append(SweepItem(name, _sweep_number(value, "tau", item), aggregate, refine))
    return parsed


def _sweep_number(text: str, what: str, item: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SystemExit(f"--sweep: {what} of {item!r} is not a number") from None
    if math.isnan(value):
        raise SystemExit(f"--sweep: {what} of {item!r} is NaN")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__)
    parser.add_argument("--pipeline", default="mmspec/shapes-video", help="zoo id or pipeline folder")
    parser.add_argument("--sweep", nargs="*", default=DEFAULT_SWEEP,
                        help="reference SDVG cases (beside the stored settings' case) as reward:tau[:min|mean]"
                             "[:refine=T] (worst frame unless mean; refine=T: the "
                             "target refines rejected drafts from its timestep T instead of redrawing them from "
                             "noise); rewards: fraction (the exact per-frame score: found "
                             "fraction of the prompted objects), match (each found object weighted by its "
                             "template match, a finer knob), imagereward (needs the --imagereward-* files)")
    parser.add_argument("--quality-prompts", type=int, default=100)
    parser.add_argument("--speed-prompts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per block")
    parser.add_argument("--draft-steps", type=int, default=None,
                        help="the drafter's denoising steps per block in the reference cases (default: the folder's "
                             "model_index.json setting, else --steps); draft and the stored case use the stored "
                             "settings")
    parser.add_argument("--sampler", default="euler", choices=["euler", "renoise"])
    parser.add_argument("--guidance-scale", type=float, default=3.0,
                        help="classifier-free guidance (the zoo's target draws the prompted objects in 2.5x more "
                             "frames at 3 than without: docs/pipeline_video.md)")
    parser.add_argument("--draft-guidance-scale", type=float, default=None,
                        help="the drafter's guidance in the reference cases (default: the folder's model_index.json "
                             "setting, else --guidance-scale)")
    parser.add_argument("--imagereward-weights", default=None, help="ImageReward.pt (quality column / routing)")
    parser.add_argument("--imagereward-med-config", default=None)
    parser.add_argument("--imagereward-tokenizer", default=None)
    add_run_arguments(parser, out_help="markdown table (.json and .png beside it)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    monitor = LoadMonitor()  # the machine's load over the whole run, recorded beside its table
    torch.set_num_threads(args.threads)
    sweep = parse_sweep(args.sweep)
    from mmspec.models.rewards import ScorerFrameReward, ShapesFrameReward
    from mmspec.pipelines.ar_video import ARVideoPipeline

    pipe = load_quiet_pipeline(ARVideoPipeline, args.pipeline, cpu_gemm=args.cpu_gemm)
    ir_files = (args.imagereward_weights, args.imagereward_med_config, args.imagereward_tokenizer)
    scorer = None
    if any(ir_files):
        if not all(ir_files):
            raise SystemExit("--imagereward-weights, --imagereward-med-config and --imagereward-tokenizer go together")
        from .imagereward import ImageRewardScorer

        scorer = ImageRewardScorer(*ir_files)
    rewards: dict[str, Any] = {name: ShapesFrameReward(mode) for name, mode in REWARD_MODES.items()}
    if scorer is not None:
        rewards["imagereward"] = ScorerFrameReward(scorer, "imagereward", 224)
    elif any(item.reward == "imagereward" for item in sweep):
        raise SystemExit("--sweep imagereward:... needs the --imagereward-* files (no weights are downloaded)")
    common = {"num_inference_steps": args.steps, "sampler": args.sampler, "guidance_scale": args.guidance_scale}
    # the stored-settings cases: a user's plain call (method name only), resolved as that call resolves it
    stored = pipe.method_config("sdvg", guidance_scale=args.guidance_scale)
    cases = {"none": case_kwargs("none", common), "draft": case_kwargs("draft", common),
             STORED_CASE: case_kwargs("sdvg", common)}
    routers = {STORED_CASE: (pipe.get_reward(stored.reward, stored.reward_kwargs), stored.tau, stored.aggregate)}
    items = {STORED_CASE: stored_item(stored)}
    for item in sweep:
        config = item.config(rewards[item.reward], args.draft_steps, args.draft_guidance_scale)
        cases[item.case_name] = case_kwargs(config, common)
        routers[item.case_name] = (rewards[item.reward], item.tau, item.aggregate)
        items[item.case_name] = item
    quality_prompts = make_video_prompt_set(args.quality_prompts)
    speed_prompts = make_video_prompt_set(args.speed_prompts, seed=args.seed + 1)
    results = run(pipe, cases, quality_prompts, speed_prompts, args.repeats, args.seed, scorer, routers=routers)
    config = pipe.transformer.config
    draft = pipe.method_config("draft", guidance_scale=args.guidance_scale)
    draft_steps, draft_guidance = pipe.draft_settings(draft.draft_num_inference_steps, draft.draft_guidance_scale)
    results.update(sweep_items={name: asdict(item) for name, item in items.items()},
                   stored_settings=stored.to_dict(),
                   **dict(zip(("reference_draft_steps", "reference_draft_guidance_scale"),
                              pipe.draft_settings(args.draft_steps, args.draft_guidance_scale))),
                   machine=machine_line(cpu_gemm=args.cpu_gemm), quality_prompts=len(quality_prompts), speed_prompts=len(speed_prompts), repeats=args.repeats,
                   frames=config.num_frames, frames_per_block=config.frames_per_block,
                   blocks=config.num_frames // config.frames_per_block, steps=args.steps, draft_steps=draft_steps,
                   sampler=args.sampler, guidance_scale=args.guidance_scale, draft_guidance_scale=draft_guidance,
                   sweep=args.sweep, target_layers=config.num_layers,
                   drafter_layers=pipe.drafter.config.num_layers)
    table = to_markdown(results, command_line("mmspec.evaluation.bench_video", argv))
    write_report(args.out, table, results, load=monitor.stop(), force=args.force_contended)
    if args.out is not None:
        plot(results, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
