"""Benchmark of ContinuousARImagePipeline (MAR target-only vs CSpD) on one zoo entry, all in one run.

Quality: for every configuration, one image per prompt of a GenEval-shapes prompt set (exact evaluator)
and FID with the shapes feature network against renders of the same prompts; two target-only runs with
different seeds ("none" and "none, seed 2") state how much both numbers move by chance alone. Speed: for
each batch size, every configuration is timed against ``"none"`` on the same prompts and seeds with
:func:`~mmspec.evaluation.speed.run_benchmark` (median of round-robin repeats after a warm-up): speedup,
images/s, CSpD's acceptance rate, tokens per target forward, target calls per image.

    python -m mmspec.evaluation.bench_continuous --out docs/benchmarks/continuous_cpu.md

A configuration names its ``"method"``; one without method settings calls the pipeline with nothing but
``method="cspd"``: the settings stored with the checkpoint (``speculation_config.json``), as a user's call
gets them. ``"reference": true`` runs :data:`REFERENCE_CONFIG` instead, the settings the benchmark ran as
CSpD before settings were stored (the official code's), as an explicit config. Other keys are fields of the
method's config, applied over the stored (or reference) settings (``--configs '{"cspd, gamma 4": {"method":
"cspd", "draft_length": 4}}'``, :class:`~mmspec.methods.cspd.CSpDConfig`), pipeline call keywords
(:data:`CALL_KEYS`, e.g. ``"num_iter"``) or ``"batches"``, the batch sizes the configuration is timed at
(default: all; quality is always measured). The first configuration must be target-only
(``{"method": "none"}``) and is the baseline.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from mmspec.methods import MethodConfig
from mmspec.methods.cspd import CSpDConfig
from mmspec.world import make_prompt_set

from .bench_cli import (
    add_run_arguments,
    command_line,
    load_quiet_pipeline,
    machine_line,
    new_parser,
    resolve_case_method,
    write_report,
)
from .bench_images import (
    SEED_DISTANCE_NOTE,
    add_quality_seeds_argument,
    reference_images,
    score_cell,
    seed_distance_cell,
    seed_distance_columns,
    seeded_quality,
    spread_note,
)
from .speed import SPEEDUP_CELL_NOTE, LoadMonitor, RunResult, run_benchmark, speedup_cell

#: The settings this benchmark ran as CSpD before the zoo stored its own (the official code's: gamma 8, 5 % of
#: the tokens pre-filled, independent verification in the round context, tau = 1): faster than the stored
#: settings, and below the target's quality on the zoo.
REFERENCE_CONFIG = CSpDConfig(draft_length=8, prefill_ratio=0.05, verify_order="independent", verify_context="round",
                              density_temperature=1.0)

#: pipeline call keywords a configuration may set (over the shared --num-iter etc.)
CALL_KEYS = ("num_iter", "num_diffusion_steps", "guidance_scale", "temperature", "cfg_schedule")
#: configuration keys that are neither config fields nor call keywords
CASE_KEYS = ("method", "reference", "batches")

#: name -> configuration (see the module docstring)
DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "none": {"method": "none"},
    "cspd": {"method": "cspd"},                                                  # the checkpoint's stored settings
    "cspd (reference)": {"method": "cspd", "reference": True},
    "cspd, chain order": {"method": "cspd", "verify_order": "chain", "batches": [8]},  # the paper's truncation
    "cspd, tau=42": {"method": "cspd", "density_temperature": 42.0},           # official code's inner temperature
    # target-only with half the iterations: what CSpD's round context amounts to (with --num-iter 64)
    "none, 32 iterations": {"method": "none", "num_iter": 32},
}
REFERENCE_SIZE = 32  # pixels of FID's real renders (the zoo's 32x32 images)


def generate(pipe: Any, prompts: Sequence[str], kwargs: dict, batch: int, seed: int) -> tuple[list[np.ndarray], list]:
    """Images (float [H, W, 3]) and per-call stats for ``prompts`` in chunks of ``batch``, one generator."""
    generator = torch.Generator().manual_seed(seed)
    images, stats = [], []
    for start in range(0, len(prompts), batch):
        out = pipe(list(prompts[start:start + batch]), generator=generator, output_type="np", **kwargs)
        images += list(out.images)
        stats.append(out.stats)
    return images, stats


def call_kwargs(pipe: Any, name: str, spec: dict[str, Any], shared: dict[str, Any], batch: int) -> dict[str, Any]:
    """The pipeline keywords of configuration ``name`` for calls of ``batch`` images: the shared settings,
    the configuration's call keywords and ``method``: the method's name when it sets no config field (the
    checkpoint's stored settings), else the stored (or, with ``"reference"``, :data:`REFERENCE_CONFIG`'s)
    config with its fields replaced. A key that is none of those is a command-line error naming it."""
    spec = dict(spec)
    method, reference = spec.pop("method", "none"), spec.pop("reference", False)
    spec.pop("batches", None)
    call = {**shared, **{key: spec.pop(key) for key in CALL_KEYS if key in spec}}
    def base() -> MethodConfig:
        return REFERENCE_CONFIG if reference else pipe.method_config(
            method, batch_size=batch, guidance_scale=call.get("guidance_scale", 3.0))

    return {**call, "method": resolve_case_method(pipe, name, method, spec, base, reference=reference,
                                                  option="--configs", keys=(*CASE_KEYS, *CALL_KEYS))}


def settings_line(pipe: Any, configs: dict[str, dict], shared: dict[str, Any], batch: int) -> dict[str, Any]:
    """What each speculative configuration runs at ``batch`` images per call (plain values, for the report)."""
    out = {}
    for name, spec in configs.items():
        method = call_kwargs(pipe, name, spec, shared, batch)["method"]
        if method != "none":
            config = method if isinstance(method, MethodConfig) else pipe.method_config(method, batch_size=batch)
            out[name] = {"stored": not isinstance(method, MethodConfig), **config.to_dict()}
    return out


def _merge(stats: list) -> Any:
    return type(stats[0]).merge(stats)


def _images_per_seed(pipe: Any, prompts: Sequence[str], kwargs: dict, batch: int, seeds: Sequence[int],
                     stats: list) -> Iterator[list[np.ndarray]]:
    """The images of ``prompts`` for each seed in turn, adding every call's stats to ``stats``."""
    for seed in seeds:
        images, seed_stats = generate(pipe, prompts, kwargs, batch, seed)
        stats.extend(seed_stats)
        yield images


def run(pipe: Any, configs: dict[str, dict], shared: dict, batch_sizes: Sequence[int], speed_prompts: Sequence[Any],
        quality_prompts: Sequence[Any], real: torch.Tensor, repeats: int, quality_batch: int, seed: int,
        quality_seeds: int = 1, log=print) -> dict:
    """Every measurement of the table; returns a JSON-able dict. Quality is measured once per generation
    seed ``seed .. seed + quality_seeds - 1`` and averaged (:func:`~.bench_images.seeded_quality`); the
    chance row "none, seed 2" uses the next seed."""
    names = list(configs)
    texts = [p.text for p in quality_prompts]
    scores: dict[str, dict[str, Any]] = {}
    for name in [*names, "none, seed 2"]:
        kwargs = call_kwargs(pipe, name, configs["none" if name == "none, seed 2" else name], shared, quality_batch)
        seeds = [seed + quality_seeds] if name == "none, seed 2" else range(seed, seed + quality_seeds)
        start = time.perf_counter()
        stats: list = []
        summary = seeded_quality(_images_per_seed(pipe, texts, kwargs, quality_batch, seeds, stats), quality_prompts,
                                 real)
        scores[name] = {**summary, "acceptance_rate": _merge(stats).acceptance_rate,
                        "seconds": round(time.perf_counter() - start, 1)}
        log(f"quality {name}: {summary['per_seed']}")
    by_batch = {}
    speed_texts = [p.text for p in speed_prompts]
    for batch in batch_sizes:
        timed = [n for n in names if batch in configs[n].get("batches", [batch]) or n == names[0]]
        cases = {n: _speed_case(pipe, speed_texts, call_kwargs(pipe, n, configs[n], shared, batch), batch, seed)
                 for n in timed}
        report = run_benchmark(cases, baseline=names[0], warmup=1, repeats=repeats, seed=seed, unit="images")
        for name, case in report.cases.items():
            case.quality.update({k: v for k, v in scores[name].items() if k in ("geneval", "fid")})
        by_batch[str(batch)] = report.to_dict()
        log(f"batch {batch}:\n{report.to_markdown()}")
    return {"quality": scores, "speed": by_batch}


def _speed_case(pipe: Any, texts: list[str], kwargs: dict, batch: int, seed: int):
    """A zero-argument benchmark case: every timed prompt once, in chunks of ``batch``."""
    def call() -> RunResult:
        images, stats = generate(pipe, texts, kwargs, batch, seed)
        return RunResult(num_items=len(images), unit="images", stats=_merge(stats))
    return call


def to_markdown(results: dict, command: str) -> str:
    shared = results["shared"]
    header, separator = seed_distance_columns(results["quality"].values())
    lines = [f"Command: `{command}`", "",
             f"Machine: {results['machine']}. Shared settings: {json.dumps(shared)}. Speed: {results['speed_prompts']} "
             f"prompts per timed call set, {results['repeats']} timed repeats (median; {SPEEDUP_CELL_NOTE}) after a warm-up, all "
             f"configurations round-robin in one process. Quality: {results['quality_prompts']} prompts, one image "
             "each (GenEval-shapes = exact evaluator, mean of the six categories; FID = shapes features vs renders "
             f"of the same prompts{spread_note(results)}).", "",
             "| batch | method | speedup | acceptance rate | images/s | tokens / target forward | target calls / image "
             "| draft calls / image | GenEval-shapes | FID |" + header,
             "|---|---|---|---|---|---|---|---|---|---|" + separator]
    for batch, report in results["speed"].items():
        for name, c in report["cases"].items():
            stats = c.get("stats") or {}
            items = c["num_items"]
            q = results["quality"][name]
            rate = f"{stats['acceptance_rate']:.3f}" if stats.get("drafted_tokens") else "-"
            lines.append(f"| {batch} | {name} | {speedup_cell(c)} | {rate} | {c['items_per_s']:.2f} | "
                         f"{c['tokens_per_target_call'] or 0:.2f} | {stats.get('target_calls', 0) / items:.1f} | "
                         f"{stats.get('draft_calls', 0) / items:.1f} | {score_cell(q, 'geneval', 3)} | "
                         f"{score_cell(q, 'fid', 1)} |" + seed_distance_cell(q, bool(header)))
    lines += ["", "Method settings (per batch size where they differ; \"stored\": the checkpoint's, as a call with "
              "only method= gets them):"]
    for name, by_batch in _settings_by_name(results.get("settings", {})).items():
        for batches, values in by_batch:
            where = f" (batch {', '.join(batches)})" if len(by_batch) > 1 else ""
            origin = "stored" if values["stored"] else "explicit"
            fields = ", ".join(f"{k}={v}" for k, v in values.items() if k != "stored")
            lines.append(f"- {name}{where}: {origin}: {fields}")
    noise = results["quality"]["none, seed 2"]
    base = results["quality"]["none"]
    lines += ["", f"Noise level: target-only with a second seed scores GenEval-shapes {noise['geneval']:.3f} "
              f"(vs {base['geneval']:.3f}) and FID {noise['fid']:.1f} (vs {base['fid']:.1f})."
              + (f" {SEED_DISTANCE_NOTE}" if header else ""), "",
              "Per configuration (quality run): " + "; ".join(
                  f"{name}: acceptance {q['acceptance_rate']:.3f}, {q['seconds']} s" for name, q in
                  results["quality"].items())]
    return "\n".join(lines) + "\n"


def _settings_by_name(settings: dict[str, dict[str, dict]]) -> dict[str, list[tuple[list[str], dict]]]:
    """``{batch: {name: values}}`` regrouped as ``{name: [(batches, values), ...]}`` (equal values merged)."""
    out: dict[str, list[tuple[list[str], dict]]] = {}
    for batch, by_name in settings.items():
        for name, values in by_name.items():
            groups = out.setdefault(name, [])
            match = next((group for group in groups if group[1] == values), None)
            if match is None:
                groups.append(([batch], values))
            else:
                match[0].append(batch)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__)
    parser.add_argument("--pipeline", default="mmspec/shapes-t2i-continuous", help="zoo id or pipeline folder")
    parser.add_argument("--configs", default=None, help="JSON {name: configuration} (the module docstring); default: "
                        "DEFAULT_CONFIGS")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--speed-prompts", type=int, default=32, help="timed prompts (the first of a shuffled set)")
    parser.add_argument("--quality-prompts", type=int, default=25, help="quality prompts per category")
    parser.add_argument("--quality-batch", type=int, default=32)
    parser.add_argument("--num-iter", type=int, default=None)
    parser.add_argument("--num-diffusion-steps", type=int, default=None)
    parser.add_argument("--guidance-scale", type=float, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--difficulty", type=float, default=0.5, help="render difficulty of FID's real images")
    add_quality_seeds_argument(parser)
    add_run_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    monitor = LoadMonitor()  # the machine's load over the whole run, recorded beside its table
    torch.set_num_threads(args.threads)
    try:
        configs = DEFAULT_CONFIGS if args.configs is None else json.loads(args.configs)
    except json.JSONDecodeError as error:
        raise SystemExit(f"--configs is not valid JSON: {error}") from None
    if not configs or next(iter(configs.values())).get("method", "none") != "none":
        raise SystemExit("the first configuration must be target-only ({'method': 'none'}): it is the baseline")
    configs = {("none" if i == 0 else name): kw for i, (name, kw) in enumerate(configs.items())}
    shared = {k: v for k, v in (("num_iter", args.num_iter), ("num_diffusion_steps", args.num_diffusion_steps),
                                ("guidance_scale", args.guidance_scale), ("temperature", args.temperature))
              if v is not None}

    from mmspec.pipelines.continuous_ar_image import ContinuousARImagePipeline

    pipe = load_quiet_pipeline(ContinuousARImagePipeline, args.pipeline, cpu_gemm=args.cpu_gemm)
    settings = {str(batch): settings_line(pipe, configs, shared, batch)  # also refuses bad configurations up front
                for batch in dict.fromkeys([args.quality_batch, *args.batch_sizes])}
    speed_prompts = make_prompt_set(n_per_category=max(1, -(-args.speed_prompts // 6)), seed=args.seed + 7)
    rng = np.random.default_rng(args.seed)
    speed_prompts = [speed_prompts[i] for i in rng.permutation(len(speed_prompts))[:args.speed_prompts]]
    quality_prompts = make_prompt_set(n_per_category=args.quality_prompts)
    real = reference_images(quality_prompts, args.difficulty, REFERENCE_SIZE, args.seed)
    results = run(pipe, configs, shared, args.batch_sizes, speed_prompts, quality_prompts, real, args.repeats,
                  args.quality_batch, args.seed, args.quality_seeds)
    results.update(machine=machine_line(cpu_gemm=args.cpu_gemm), speed_prompts=len(speed_prompts), quality_prompts=len(quality_prompts),
                   quality_seeds=args.quality_seeds, repeats=args.repeats, configs=configs, shared=shared,
                   settings=settings)
    table = to_markdown(results, command_line("mmspec.evaluation.bench_continuous", argv))
    write_report(args.out, table, results, load=monitor.stop(), force=args.force_contended)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
