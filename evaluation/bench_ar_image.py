"""Benchmark of ARImagePipeline's methods on one zoo entry: speed and quality, all measured in one run.

For each decoding mode (greedy, and sampling at temperature 1) and each batch size, every method is
timed against ``method="none"`` on the same prompts and seeds with :func:`~mmspec.evaluation.speed.run_benchmark`
(speedup, mean accepted length, images/s, target calls per image, peak memory). Quality is measured
once per mode and method on a larger prompt set: the exact-evaluator GenEval-shapes score and FID with
the shapes feature network against images rendered from the same prompts. A second baseline run with
another seed ("none, seed 2") states how much GenEval and FID move by chance alone.

    python -m mmspec.evaluation.bench_ar_image --out docs/benchmarks/ar_image_cpu.md

A case named after a method (``eagle``, ``lantern``, ...) calls the pipeline with nothing but ``method=``: the
settings stored with the checkpoint (``speculation_config.json``) for the mode and batch, as a user's call
gets them. ``M (reference)`` runs the same method with :data:`REFERENCE_CONFIGS`, the settings the benchmark
measured fastest on the zoo before they were stored, as explicit configs, so a run shows both. A case's
config fields override the stored (or reference) settings: ``--method-kwargs '{"lantern": {"delta": 0.3}}'``
(the fields of the method's config, :mod:`mmspec.methods`; a ``"tree"`` as a JSON object). A case may
draft with another EAGLE head than the pipeline's by naming its folder, so two heads are compared in one
run: ``--method-kwargs '{"eagle, other head": {"like": "eagle", "eagle_head": "runs/x/head"}}'``; likewise
another MuLo-SD drafter and up-sampler, from a pipeline folder that holds them:
``'{"mulo, other pair": {"like": "mulo", "mulo_models": "runs/x"}}'``.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmspec.cpu_gemm import CPU_GEMM_MODES, pack_cpu_linears
from mmspec.methods import MethodConfig
from mmspec.methods.eagle import EagleConfig, LanternConfig
from mmspec.methods.jacobi import GSDConfig, SJDConfig
from mmspec.methods.mulo import MuLoConfig
from mmspec.methods.relaxed import EntropySDConfig
from mmspec.pipelines.ar_image import MOVED_KEYWORDS
from mmspec.stats import SpecStats
from mmspec.validation import dtype_argument
from mmspec.world import make_prompt_set

from .bench_cli import (
    add_common_arguments,
    call_kwargs,
    command_line,
    load_bench_pipeline,
    machine_line,
    method_kwargs,
    new_parser,
    reference_of,
    resolve_case_method,
    write_report,
)
from .bench_images import (
    SEED_DISTANCE_NOTE,
    add_quality_seeds_argument,
    quality,
    reference_images,
    score_cell,
    seed_distance_cell,
    seed_distance_columns,
    seeded_quality,
    spread_note,
)
from .speed import (
    BREAKDOWN_NOTE,
    SPEEDUP_CELL_NOTE,
    BenchmarkReport,
    LoadMonitor,
    RunResult,
    run_benchmark,
    speedup_cell,
)

DEFAULT_METHODS = ("none", "eagle", "eagle (reference)", "lantern", "lantern (reference)", "lantern, TV budget",
                   "lantern, released residual", "sjd", "sjd (reference)", "scd", "gsd", "gsd (reference)",
                   "gsd, released window", "gsd, released code", "mulo", "mulo (reference)", "mulo, parallel",
                   "mulo, sequential", "mulo, reverify, exact")

_BLOCK_CHAIN = dict(num_draft_tokens=4, draft_confidence_threshold=0.3, lookup_tail=16, lookup_only_from=4)
_LANTERN_RULE = dict(k=512, lam=10.0)
#: The drafting fields of ``EntropySDConfig`` / ``CoolSDConfig`` as the classes default them (read off the class)
_CLASS_DRAFTING = {name: getattr(EntropySDConfig(), name) for name in
                   ("num_draft_tokens", "draft_confidence_threshold", "argmax_drafts", "lookup_tail",
                    "lookup_only_from", "k")}

#: The settings this benchmark measured fastest on the zoo (2-core CPU, float32, CFG 3, a block head with
#: ``num_future`` 4 and a 2048-code VQ) before they were stored with the checkpoint: per method, per decoding
#: mode ("greedy" / "sampled") and images per call ("one" / "several"; "any": every case). The "M (reference)"
#: cases run them as explicit configs next to the stored settings ("M"). What each was measured against is in
#: ``models/recipes/build_zoo_t2i.py`` (``SPECULATION_SETTINGS``, the stored table they were copied into).
REFERENCE_CONFIGS: dict[str, dict[str, MethodConfig]] = {
    "eagle": {
        "greedy, one": EagleConfig(**_BLOCK_CHAIN),  # one block from the block head, a lookup tail
        "sampled, one": EagleConfig(argmax_drafts=True, **_BLOCK_CHAIN),  # argmax blocks, accepted exactly
        "greedy, several": EagleConfig(num_draft_tokens=5, draft_confidence_threshold=0.5),
        "sampled, several": EagleConfig(num_draft_tokens=2, draft_confidence_threshold=0.5),
    },
    "lantern": {
        "greedy, one": LanternConfig(**_BLOCK_CHAIN),
        "sampled, one": LanternConfig(argmax_drafts=True, **_BLOCK_CHAIN, **_LANTERN_RULE),  # argmax blocks, LANTERN++
        "greedy, several": LanternConfig(num_draft_tokens=5, draft_confidence_threshold=0.5),
        "sampled, several": LanternConfig(argmax_drafts=True, num_draft_tokens=4, draft_confidence_threshold=0.5,
                                          **_LANTERN_RULE),
    },
    "sjd": {"any": SJDConfig(window=8, init="left")},
    "gsd": {"any": GSDConfig(window=8, init="left", group_size=6, prob_threshold=1.0)},
    "mulo": {"any": MuLoConfig(resample="reverify")},
}


def reference_config(method: str, greedy: bool, batch_size: int) -> MethodConfig:
    """:data:`REFERENCE_CONFIGS`'s config of ``method`` for a decoding mode and images per call."""
    table = REFERENCE_CONFIGS[method]
    key = f"{'greedy' if greedy else 'sampled'}, {'one' if batch_size == 1 else 'several'}"
    return table.get(key, table.get("any"))


def default_cases() -> dict[str, dict[str, Any]]:
    """The benchmark's cases (overridable with --method-kwargs): a case named other than its pipeline method
    says which with a "method" key; ``"reference": True`` starts from :func:`reference_config` instead of
    the checkpoint's stored settings; other keys are fields of the method's config (applied over those
    settings), ``"rule": "exact"``, pipeline call keywords (``guidance_scale``) or :func:`generate`'s
    ``eagle_head``, ``mulo_models``, ``dtype`` and ``cpu_gemm``. A case without config fields calls the
    pipeline with nothing but ``method=`` (the stored settings, as a user's call)."""
    cases: dict[str, dict[str, Any]] = {"none": {}}
    for method in REFERENCE_CONFIGS:
        cases[method] = {}
        cases[f"{method} (reference)"] = {"method": method, "reference": True}
    cases.update({
        "scd": {},  # speculative coupled decoding: SJD with coupled redraws (stored settings)
        "sjd_pac": {},  # SJD-PAC: proactive trees and adaptive continuation (stored settings)
        # the released code's behaviour where it departs from mmspec's defaults (docs/official_code.md)
        "lantern, released residual": {"method": "lantern", "residual_kind": "zero_target_neighbors"},
        "gsd, released window": {"method": "gsd", "group_window": "official"},
        "gsd, released code": {"method": "gsd", "group_size": 14, "prob_threshold": 0.15, "group_window": "official",
                               "distance_space": "input_embeddings", "distance_threshold": math.sqrt(0.5)},
        # LANTERN's TV budget over the stored chains, and an explicit LANTERN++ bound (also when greedy)
        "lantern, TV budget": {"method": "lantern", "k": 64, "delta": 0.2, "lam": None},
        "lantern++": {"method": "lantern", **_LANTERN_RULE},
        # MuLo-SD's resampling modes: the paper's parallel one (fastest; the zoo's images collapse, so never a
        # default), sequential, and the stored reverify with the exact rule (lossless)
        "mulo, parallel": {"method": "mulo", "resample": "parallel"},
        "mulo, sequential": {"method": "mulo", "resample": "sequential"},
        "mulo, reverify": {"method": "mulo", "resample": "reverify"},
        "mulo, reverify, exact": {"method": "mulo", "resample": "reverify", "rule": "exact"},
        # entropy-aware and Cool-SD relaxations: the stored settings (LANTERN's drafting), and the config
        # classes' own defaults (sampled chains of 4 over every neighbour) as explicit fields
        "entropy_sd": {},
        "cool_sd": {},
        "entropy_sd (class defaults)": {"method": "entropy_sd", **_CLASS_DRAFTING},
        "cool_sd (class defaults)": {"method": "cool_sd", **_CLASS_DRAFTING},
    })
    return cases


#: case keys that are not config fields: what :func:`generate` and the pipeline call read
CASE_KEYS = ("method", "reference", "rule", "guidance_scale", "eagle_head", "mulo_models", "dtype", "cpu_gemm")


MODES = {"greedy": {"do_sample": False}, "temperature_1": {"do_sample": True, "temperature": 1.0}}


_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pipeline -> {(what, folder): loaded modules}


def _loaded_once(pipe: Any, what: str, folder: str, load: Any) -> Any:
    """``load()`` once per pipeline, ``what`` and folder: modules in the target's dtype, packed like the
    pipeline's own (``--cpu-gemm packed``)."""
    loaded = _LOADED.setdefault(pipe, {})
    if (what, folder) not in loaded:
        modules = load()
        for module in modules if isinstance(modules, tuple) else (modules,):
            module.to(pipe.transformer.dtype).eval()
            if pipe.packed_cpu_gemm:
                pack_cpu_linears(module)
        loaded[what, folder] = modules
    return loaded[what, folder]


@contextmanager
def drafting_with_head(pipe: Any, folder: str | None) -> Iterator[None]:
    """Draft with the EAGLE head saved in ``folder`` (None: the pipeline's own) while a case runs: a plain head
    replaces the ``eagle_head`` and no ``eagle_block_head`` is used, a head with ``num_future`` > 1 replaces
    the ``eagle_block_head`` (the ``eagle_head`` keeps the token-by-token chains)."""
    if folder is None:
        yield
        return

    def load() -> Any:
        from mmspec.models.eagle import EagleHead

        if not (Path(folder) / "config.json").is_file():
            raise SystemExit(f"--method-kwargs: no EAGLE head saved in eagle_head={folder!r}")
        head = EagleHead.from_pretrained(folder)
        return head.bind_target(pipe.transformer.get_input_embeddings(), pipe.transformer.get_output_embeddings())

    head, own = _loaded_once(pipe, "eagle_head", folder, load), (pipe.eagle_head, pipe.eagle_block_head)
    if head.config.num_future > 1:
        pipe.eagle_block_head = head
    else:
        pipe.eagle_head, pipe.eagle_block_head = head, None
    try:
        yield
    finally:
        pipe.eagle_head, pipe.eagle_block_head = own


@contextmanager
def drafting_with_mulo(pipe: Any, folder: str | None) -> Iterator[None]:
    """Draft MuLo-SD with the low-res drafter and up-sampler saved in the pipeline folder ``folder`` (its
    ``mulo_drafter/`` and ``mulo_upsampler/``; None: the pipeline's own) while a case runs."""
    if folder is None:
        yield
        return

    def load() -> tuple[Any, Any]:
        from mmspec.models.llamagen import LlamaGenTransformer
        from mmspec.models.mulo import TokenUpsampler, check_mulo_pair

        parts = [Path(folder) / part for part in ("mulo_drafter", "mulo_upsampler")]
        if not all((part / "config.json").is_file() for part in parts):
            raise SystemExit(f"--method-kwargs: no MuLo drafter and up-sampler saved in mulo_models={folder!r}")
        pair = LlamaGenTransformer.from_pretrained(parts[0]), TokenUpsampler.from_pretrained(parts[1])
        try:
            check_mulo_pair(pipe.transformer, *pair)
        except ValueError as error:
            raise SystemExit(f"--method-kwargs: mulo_models={folder!r} does not fit the pipeline's target: {error}") from None
        return pair

    pair, own = _loaded_once(pipe, "mulo_models", folder, load), (pipe.mulo_drafter, pipe.mulo_upsampler)
    pipe.mulo_drafter, pipe.mulo_upsampler = pair
    try:
        yield
    finally:
        pipe.mulo_drafter, pipe.mulo_upsampler = own


_VARIANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pipeline -> {(dtype, cpu_gemm): its copy}


def pipeline_variant(pipe: Any, dtype: str | None = None, cpu_gemm: str | None = None) -> Any:
    """``pipe`` computing in ``dtype`` (a ``--dtype`` name) with ``cpu_gemm`` (``"packed"`` or ``"plain"``,
    see :data:`mmspec.cpu_gemm.CPU_GEMM_MODES`); None keeps the run's. A copy made once per pipeline and
    variant and kept, so a case can run, e.g., a float32 baseline beside the run's bfloat16 rows, or plain
    GEMMs beside packed ones."""
    wanted = pipe.transformer.dtype
    if dtype is not None:
        try:
            wanted = dtype_argument(dtype)
        except argparse.ArgumentTypeError as error:
            raise SystemExit(f"--method-kwargs: dtype {error}") from None
    if cpu_gemm is not None and cpu_gemm not in CPU_GEMM_MODES:
        raise SystemExit(f"--method-kwargs: cpu_gemm must be one of {CPU_GEMM_MODES}, got {cpu_gemm!r}")
    if wanted == pipe.transformer.dtype and (cpu_gemm is None or (cpu_gemm == "packed") == pipe.packed_cpu_gemm):
        return pipe
    key = (str(wanted), cpu_gemm)
    copies = _VARIANTS.setdefault(pipe, {})
    if key not in copies:
        from diffusers.utils import logging as diffusers_logging

        level = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # its per-module "keep in float32: []" notes name no module here
        try:
            variant = copy.deepcopy(pipe).to(wanted)
        finally:
            diffusers_logging.set_verbosity(level)
        if cpu_gemm is not None:
            variant.set_cpu_gemm(cpu_gemm)
        copies[key] = variant
    return copies[key]


def case_method(pipe: Any, case: str, spec: dict[str, Any], mode: dict, batch_size: int
                ) -> tuple[str | MethodConfig, dict[str, Any]]:
    """The ``method=`` of a case for one mode and batch size (:func:`~.bench_cli.resolve_case_method`: the stored
    settings, or with ``"reference"`` :func:`reference_config`'s config, with the case's fields replaced) and
    the case's other keywords (:data:`CASE_KEYS`)."""
    spec = dict(spec)
    method, reference = spec.pop("method", case), spec.pop("reference", False)
    extra = {key: spec.pop(key) for key in CASE_KEYS if key in spec}
    greedy = not mode.get("do_sample", True)

    def base() -> MethodConfig:
        if reference:
            reference_of(REFERENCE_CONFIGS, case, method)
            return reference_config(method, greedy, batch_size)
        return pipe.method_config(method, do_sample=not greedy, batch_size=batch_size,
                                  guidance_scale=extra.get("guidance_scale", 3.0))

    def hint(key: str) -> str:
        moved = MOVED_KEYWORDS.get(key)
        return f" ({key} is now the config field {moved[0]!r})" if moved else ""

    return resolve_case_method(pipe, case, method, spec, base, reference=reference, keys=CASE_KEYS, hint=hint), extra


def generate(pipe: Any, prompts: Sequence[str], case: str, kwargs: dict, mode: dict, batch: int, seed: int,
             settings_batch: int | None = None) -> tuple[list[np.ndarray], list[Any]]:
    """Images (float [H, W, 3]) and per-call stats for ``prompts`` in chunks of ``batch``; the case's
    ``method=`` is :func:`case_method`'s for ``settings_batch`` images per call (default ``batch``; the quality
    runs generate in larger chunks with the settings of one image per call, passed as that explicit config);
    ``kwargs["eagle_head"]``, a folder, drafts with that head instead of the pipeline's,
    ``kwargs["mulo_models"]``, a pipeline folder, with its MuLo-SD drafter and up-sampler;
    ``kwargs["dtype"]`` (``"float32"`` or ``"bfloat16"``) and ``kwargs["cpu_gemm"]`` (``"packed"`` or
    ``"plain"``) run the case so instead of the run's ``--dtype`` and ``--cpu-gemm``."""
    settings_batch = batch if settings_batch is None else settings_batch
    method, extra = case_method(pipe, case, kwargs, mode, settings_batch)
    if isinstance(method, str) and method != "none" and settings_batch != min(batch, len(prompts)):
        method = pipe.method_config(method, do_sample=mode.get("do_sample", True), batch_size=settings_batch,
                                    guidance_scale=extra.get("guidance_scale", 3.0))
    head_folder, mulo_folder = extra.pop("eagle_head", None), extra.pop("mulo_models", None)
    pipe = pipeline_variant(pipe, extra.pop("dtype", None), extra.pop("cpu_gemm", None))
    generator = torch.Generator().manual_seed(seed)
    images, stats = [], []
    with drafting_with_head(pipe, head_folder), drafting_with_mulo(pipe, mulo_folder):
        for start in range(0, len(prompts), batch):
            out = pipe(list(prompts[start:start + batch]), method=method, output_type="np", generator=generator,
                       **mode, **call_kwargs(extra, greedy=not mode.get("do_sample", True)))
            images += list(out.images)
            stats.append(out.stats)
    return images, stats


def resolved_configs(pipe: Any, cases: dict[str, dict], modes: Sequence[str], batch_sizes: Sequence[int]
                     ) -> dict[str, dict[str, dict[str, Any]]]:
    """What every case ran as, per mode and batch size (JSON): its config's fields (None: target-only), the
    stored ones for a case that passes only ``method=``."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for mode_name in modes:
        mode = MODES[mode_name]
        out[mode_name] = {}
        for batch in batch_sizes:
            configs = {}
            for case, spec in cases.items():
                method, extra = case_method(pipe, case, spec, mode, batch)
                if isinstance(method, str):
                    method = pipe.method_config(method, do_sample=mode.get("do_sample", True), batch_size=batch,
                                                guidance_scale=extra.get("guidance_scale", 3.0))
                configs[case] = None if method is None else {"config": type(method).__name__, **method.to_dict()}
            out[mode_name][str(batch)] = configs
    return out


def run(pipe: Any, methods: Sequence[str], cases: dict[str, dict[str, Any]], modes: Sequence[str],
        batch_sizes: Sequence[int], speed_prompts: Sequence[Any], quality_prompts: Sequence[Any], real: torch.Tensor,
        repeats: int, quality_batch: int, seed: int, quality_seeds: int = 1, log=print) -> dict:
    """Every measurement of the table. ``cases[method]`` is a case's spec (:func:`default_cases`), resolved
    per mode and timed batch size by :func:`case_method`; quality is measured with the settings of one image
    per call (the headline settings), generated in chunks of ``quality_batch``, once per generation seed
    ``seed .. seed + quality_seeds - 1`` (:func:`~.bench_images.seeded_quality`: the mean and the spread
    across seeds). The chance row "none, seed 2" uses the next seed, one no method row used (no seeds:
    ``mean_quality`` refuses). Returns a JSON-able dict."""
    results: dict[str, Any] = {"modes": {}}
    for mode_name in modes:
        mode = MODES[mode_name]
        texts = [p.text for p in quality_prompts]
        scores: dict[str, dict[str, Any]] = {}
        for method in methods if quality_prompts else ():
            start = time.perf_counter()
            image_sets = (generate(pipe, texts, method, cases[method], mode, quality_batch, s, settings_batch=1)[0]
                          for s in range(seed, seed + quality_seeds))
            scores[method] = seeded_quality(image_sets, quality_prompts, real)
            log(f"[{mode_name}] quality {method}: {scores[method]['per_seed']} "
                f"({time.perf_counter() - start:.0f} s)")
        if quality_prompts:
            images, _ = generate(pipe, texts, "none", {}, mode, quality_batch, seed + quality_seeds)
            scores["none, seed 2"] = quality(images, quality_prompts, real)
            log(f"[{mode_name}] quality none, seed 2: {scores['none, seed 2']}")

        by_batch = {}
        speed_texts = [p.text for p in speed_prompts]
        for batch in batch_sizes:
            timed = {m: _speed_case(pipe, speed_texts, m, cases[m], mode, batch, seed) for m in methods}
            report = run_benchmark(timed, baseline=methods[0], warmup=1, repeats=repeats, seed=seed, unit="images")
            for method, c in report.cases.items():
                c.quality.update({key: scores[method][key] for key in ("geneval", "fid") if method in scores})
            by_batch[str(batch)] = report.to_dict()
            log(f"[{mode_name}] batch {batch}:\n{report.to_markdown()}")
        results["modes"][mode_name] = {"quality": scores, "speed": by_batch}
    return results


def _speed_case(pipe: Any, texts: list[str], method: str, kwargs: dict, mode: dict, batch: int, seed: int):
    """A zero-argument benchmark case: every timed prompt once, in chunks of ``batch``."""
    def call() -> RunResult:
        images, stats = generate(pipe, texts, method, kwargs, mode, batch, seed)
        return RunResult(num_items=len(images), unit="images", stats=SpecStats.merge(stats))
    return call


def to_markdown(results: dict, command: str) -> str:
    spread = spread_note(results)
    lines = [f"Command: `{command}`", "",
             f"Machine: {results['machine']}; {results['speed_prompts']} prompts per timed call set, "
             f"{results['repeats']} timed repeats (median; {SPEEDUP_CELL_NOTE}), quality on {results['quality_prompts']} prompts "
             f"(GenEval-shapes = exact evaluator, FID = shapes features vs renders of the same prompts{spread}).", ""]
    for mode_name, mode in results["modes"].items():
        header, separator = seed_distance_columns(mode["quality"].values())
        lines += [f"### {mode_name.replace('_', ' ')}", "",
                  "| batch | method | speedup | mean acc. len | images/s | target calls / image | GenEval-shapes | FID |"
                  + header, "|---|---|---|---|---|---|---|---|" + separator]
        for batch, report in mode["speed"].items():
            for name, c in report["cases"].items():
                stats = c.get("stats") or {}
                calls = stats.get("target_calls")
                per_image = calls / c["num_items"] if calls else float("nan")
                q = mode["quality"].get(name, {})
                lines.append(f"| {batch} | {name} | {speedup_cell(c)} | {c['mean_accepted_length'] or 0:.2f} | "
                             f"{c['items_per_s']:.2f} | {per_image:.1f} | {score_cell(q, 'geneval', 3)} | "
                             f"{score_cell(q, 'fid', 2)} |" + seed_distance_cell(q, bool(header)))
        noise = mode["quality"].get("none, seed 2")
        if noise:
            lines += ["", f"Chance level: target-only with another seed scores GenEval-shapes {noise['geneval']:.3f}, "
                      f"FID {noise['fid']:.2f}." + (f" {SEED_DISTANCE_NOTE}" if header else "")]
        for batch, report in mode["speed"].items():
            lines += ["", f"Round breakdown, batch {batch} ({BREAKDOWN_NOTE}):", "",
                      BenchmarkReport.from_dict(report).breakdown_markdown().rstrip()]
        lines.append("")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__)
    add_common_arguments(parser, DEFAULT_METHODS)
    parser.add_argument("--pipeline", default="mmspec/shapes-t2i", help="zoo id or pipeline folder")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--speed-prompts", type=int, default=4, help="timed prompts per category (6 categories)")
    parser.add_argument("--quality-prompts", type=int, default=50,
                        help="quality prompts per category (0: a speed-only run, no quality columns)")
    parser.add_argument("--quality-batch", type=int, default=8)
    add_quality_seeds_argument(parser)
    parser.add_argument("--difficulty", type=float, default=0.5, help="render difficulty of FID's real images")
    parser.add_argument("--guidance-scale", type=float, default=None, help="override every method's guidance")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    monitor = LoadMonitor()  # the machine's load over the whole run, recorded beside its table
    torch.set_num_threads(args.threads)

    from mmspec.pipelines import ARImagePipeline

    pipe = load_bench_pipeline(ARImagePipeline, args)
    cases = method_kwargs(args.methods, default_cases(), args.method_kwargs, derived_cases=True)
    if args.guidance_scale is not None:
        for case in cases.values():
            case["guidance_scale"] = args.guidance_scale
    configs = resolved_configs(pipe, cases, args.modes, sorted({1, *args.batch_sizes}))  # checks every case too
    speed_prompts = make_prompt_set(n_per_category=args.speed_prompts, seed=args.seed + 7)
    quality_prompts = make_prompt_set(n_per_category=args.quality_prompts) if args.quality_prompts else []
    image_size = pipe.grid_size * int(getattr(pipe.vqvae.config, "patch_size", 1))
    real = reference_images(quality_prompts, args.difficulty, image_size, args.seed) if quality_prompts else None
    results = run(pipe, args.methods, cases, args.modes, args.batch_sizes, speed_prompts, quality_prompts, real,
                  args.repeats, args.quality_batch, args.seed, args.quality_seeds)
    results.update(machine=machine_line(args.dtype, args.cpu_gemm, pipe.transformer.device), speed_prompts=len(speed_prompts), quality_prompts=len(quality_prompts),
                   quality_seeds=args.quality_seeds, repeats=args.repeats, cases=cases, configs=configs)
    table = to_markdown(results, command_line("mmspec.evaluation.bench_ar_image", argv))
    write_report(args.out, table, results, load=monitor.stop(), force=args.force_contended)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
