"""Benchmark of :class:`~mmspec.pipelines.VLMPipeline` on the shapes zoo: every method, and transformers'
own assisted generation on the same target, measured in one run.

    python -m mmspec.evaluation.bench_vlm --out docs/benchmarks/vlm_cpu.md

Tasks: detailed descriptions of held-out images and narrations of held-out 4-frame videos (the captioner's
long-output tasks; test split, never trained on). Modes: temperature 0 (greedy) and temperature 1. Batch
sizes 1 and 4. Rows per (mode, task, batch): ``none`` (target-only, the baseline every speedup is measured
against), the draft heads, ``draft_vlm`` (the standalone draft VLM in our loop), and at batch 1
``hf_generate`` (plain ``target.generate``), ``hf_assisted`` (``generate(assistant_model=draft VLM)``) and
``hf_prompt_lookup`` (``generate(prompt_lookup_num_tokens=...)``): transformers' assisted generation is
batch-1 only. Columns: speedup over ``none`` (end to end: image encoding and prefill included), mean
accepted length (bonus token included), tokens/s, visual positions the drafter attends to, peak memory,
and exact-match accuracy of the outputs against the world's reference text (lossless methods match
``none`` at temperature 0; at temperature 1 they sample the same distribution).

A row named after a method (``flash``) calls the pipeline with nothing but ``method=``: the settings stored
with the checkpoint (``speculation_config.json``) for the mode and batch, as a user's call gets them.
``M (reference)`` runs the same method with :data:`REFERENCE_CONFIGS`, the chain lengths this benchmark ran
before they were stored, as explicit configs. A case's config fields override the stored (or reference)
settings, and variants run under their own names:
``--method-kwargs '{"eagle, K=6": {"like": "eagle", "num_draft_tokens": 6}}'`` (the fields of the method's
config, :mod:`mmspec.methods.vlm_heads`; a ``"tree"`` as a JSON object).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mmspec.methods import MethodConfig
from mmspec.methods.vlm_heads import DraftVLMConfig, FlashConfig, SpecVLMConfig, ViSpecConfig, VLMEagleConfig
from mmspec.stats import SpecStats

from .bench_cli import (
    add_common_arguments,
    command_line,
    load_quiet_pipeline,
    machine_line,
    method_kwargs,
    reference_of,
    resolve_case_method,
    write_report,
)
from .speed import BREAKDOWN_NOTE, BenchmarkReport, LoadMonitor, RunResult, run_benchmark

#: The chain lengths this benchmark ran before they were stored with the checkpoint, the same in every mode
#: and batch size: the zoo's trained heads are accepted so often that long chains pay (K = 6 / 8 / 12 for
#: EAGLE are compared in docs/pipeline_vlm.md); FLASH's 10 = two semi-AR forwards of 5. The "M (reference)"
#: rows run them as explicit configs next to the stored settings ("M"); the stored table is
#: ``models/recipes/build_zoo_vlm.py``'s ``SPECULATION_SETTINGS``.
REFERENCE_CONFIGS: dict[str, MethodConfig] = {
    "eagle": VLMEagleConfig(num_draft_tokens=10), "flash": FlashConfig(num_draft_tokens=10),
    "vispec": ViSpecConfig(num_draft_tokens=10), "specvlm": SpecVLMConfig(num_draft_tokens=10),
    "draft_vlm": DraftVLMConfig(num_draft_tokens=8),
}
#: case keys that are not config fields
CASE_KEYS = ("method", "reference")


def default_cases() -> dict[str, dict[str, Any]]:
    """The benchmark's cases: ``none``, then per method its stored settings (``{}``: only ``method=``) and its
    reference row (``"reference": True``); a case named other than its method says which with "method"."""
    cases: dict[str, dict[str, Any]] = {"none": {}}
    for method in REFERENCE_CONFIGS:
        cases[method] = {}
        cases[f"{method} (reference)"] = {"method": method, "reference": True}
    return cases


METHODS = tuple(default_cases())
HF_CASES = ("hf_generate", "hf_assisted", "hf_prompt_lookup")
MODES = {"temperature_0": {"do_sample": False}, "temperature_1": {"do_sample": True, "temperature": 1.0}}
TASKS = {"image": "describe", "video": "narrate"}


def task_examples(task: str, count: int, seed: int) -> list[dict]:
    """Held-out examples (frames, prompt, reference answer) of a task from the test split."""
    from mmspec.models import shapes_vlm as sv

    if task == "image":
        return [sv.image_example("test", seed, i, "describe") for i in range(count)]
    return [sv.video_example("test", seed, i, "narrate") for i in range(count)]


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def case_method(pipe: Any, case: str, spec: dict[str, Any], mode: dict, batch_size: int) -> str | MethodConfig:
    """The ``method=`` of a case for one mode and batch size (:func:`~.bench_cli.resolve_case_method`): the stored
    settings, or with ``"reference"`` :data:`REFERENCE_CONFIGS`'s config, with the case's fields replaced."""
    fields = {key: value for key, value in spec.items() if key not in CASE_KEYS}
    method, reference = spec.get("method", case), spec.get("reference", False)

    def base() -> MethodConfig:
        if reference:
            return reference_of(REFERENCE_CONFIGS, case, method)
        return pipe.method_config(method, do_sample=mode.get("do_sample", False), batch_size=batch_size)

    return resolve_case_method(pipe, case, method, fields, base, reference=reference, keys=CASE_KEYS)


def pipeline_case(pipe: Any, examples: list[dict], method: str | MethodConfig, mode: dict, batch: int,
                  max_new_tokens: int, seed: int) -> Callable[[], RunResult]:
    """Every example once, ``batch`` at a time, through the pipeline with ``method=method`` (a name: the
    stored settings; a config: as given) and nothing else of the method."""
    def call() -> RunResult:
        generator = torch.Generator().manual_seed(seed)
        texts, stats, visual = [], [], []
        for chunk in _chunks(examples, batch):
            frames = [list(e["frames"]) for e in chunk]
            out = pipe(videos=frames, prompt=[e["prompt"] for e in chunk], method=method, generator=generator,
                       max_new_tokens=max_new_tokens, **mode)
            texts += out.text
            stats.append(out.stats)
            visual += out.draft_visual_tokens or []
        merged = SpecStats.merge(stats)
        quality = {"accuracy": _accuracy(texts, examples)}
        if visual:
            quality["draft visual tokens"] = sum(visual) / len(visual)
        return RunResult(num_items=merged.tokens, stats=merged, quality=quality, output=texts)
    return call


def transformers_case(pipe: Any, examples: list[dict], case: str, mode: dict, max_new_tokens: int, seed: int
                      ) -> Callable[[], RunResult]:
    """transformers' ``generate`` on the same target, one example at a time.

    The image placeholder and the other non-text special tokens are suppressed (for target and assistant):
    in transformers' assisted generation a drafted ``<image>`` token makes the target's verification pass
    see more placeholders than images and fail. A trained captioner gives them ~0 probability, so outputs
    are unchanged; untrained test models do emit them."""
    options: dict[str, Any] = {"hf_generate": {}, "hf_assisted": {"assistant_model": pipe.draft_model},
                               "hf_prompt_lookup": {"prompt_lookup_num_tokens": 10}}[case]
    eos = pipe.eos_token_ids
    tokenizer = pipe.tokenizer
    specials = sorted({tokenizer.convert_tokens_to_ids(t) for t in
                       (pipe.processor.image_token, tokenizer.pad_token, tokenizer.bos_token, tokenizer.unk_token)
                       if t is not None} - set(eos))

    def call() -> RunResult:
        torch.manual_seed(seed)
        texts, tokens = [], 0
        if pipe.draft_model is not None:
            pipe.draft_model.generation_config.suppress_tokens = specials
        for e in examples:
            inputs = pipe.encode(None, e["prompt"], videos=[list(e["frames"])]).inputs
            out = pipe.target.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                       eos_token_id=eos, suppress_tokens=specials, **mode, **options)
            new = out[0, inputs["input_ids"].shape[1]:]
            tokens += int(new.shape[0])
            texts.append(pipe.tokenizer.decode(new, skip_special_tokens=True))
        return RunResult(num_items=tokens, quality={"accuracy": _accuracy(texts, examples)}, output=texts)
    return call


def _accuracy(texts: Sequence[str], examples: Sequence[dict]) -> float:
    return sum(t.strip() == e["answer"].strip() for t, e in zip(texts, examples)) / max(1, len(examples))


def resolved_configs(pipe: Any, methods: dict[str, str | MethodConfig], mode: dict, batch_size: int
                     ) -> dict[str, dict[str, Any] | None]:
    """What every case ran as (JSON): its config's fields, the stored ones for a case that passes only
    ``method=`` (None: target-only)."""
    configs = {}
    for case, method in methods.items():
        if isinstance(method, str):
            method = pipe.method_config(method, do_sample=mode.get("do_sample", False), batch_size=batch_size)
        configs[case] = None if method is None else {"config": type(method).__name__, **method.to_dict()}
    return configs


def run(pipe: Any, methods: Sequence[str], cases: dict[str, dict], modes: Sequence[str], tasks: Sequence[str],
        batch_sizes: Sequence[int], num_examples: int, max_new_tokens: int, repeats: int, seed: int,
        hf_cases: Sequence[str], log: Callable[[str], None] = print) -> dict:
    """Every measurement of the table; ``cases[m]`` is a case's spec (:func:`default_cases`), resolved per
    mode and batch size by :func:`case_method`. Returns a JSON-able dict (each report with the configs its
    cases ran as)."""
    results: dict[str, Any] = {}
    for task in tasks:
        examples = task_examples(task, num_examples, seed)
        for mode_name in modes:
            mode = MODES[mode_name]
            for batch in batch_sizes:
                resolved = {m: case_method(pipe, m, cases[m], mode, batch) for m in methods}
                timed = {m: pipeline_case(pipe, examples, method, mode, batch, max_new_tokens, seed)
                         for m, method in resolved.items()}
                if batch == 1:
                    timed.update({c: transformers_case(pipe, examples, c, mode, max_new_tokens, seed)
                                  for c in hf_cases})
                report = run_benchmark(timed, baseline="none", warmup=1, repeats=repeats, seed=seed)
                key = f"{task} / {mode_name} / batch {batch}"
                results[key] = {**report.to_dict(), "configs": resolved_configs(pipe, resolved, mode, batch)}
                log(f"## {key}\n{report.to_markdown()}")
    return results


def to_markdown(results: dict, command: str, meta: dict) -> str:
    lines = [f"Command: `{command}`", "",
             f"Machine: {meta['machine']}. {meta['examples']} held-out examples per task, {meta['repeats']} timed "
             f"repeats (median), up to {meta['max_new_tokens']} new tokens. Speedups are end to end (image encoding "
             "and prefill included) against `none` in the same run. Mean accepted length counts the bonus token. "
             "A row named after a method calls the pipeline with only `method=` (the settings stored with the "
             "checkpoint, speculation_config.json); `M (reference)` rows run the chain lengths this benchmark used "
             "before they were stored, as explicit configs. "
             "hf_* rows are transformers' `generate` on the same target (batch 1 only). Time spread: the "
             "interquartile range of the repeats' times over their median (how much this machine moved during the "
             "case; a speedup is only as steady as its row's and `none`'s).", ""]
    header = ("| method | speedup | time spread | mean acc. len | step compression | tokens/s | draft visual tokens | "
              "peak mem MiB | accuracy |\n|---|---|---|---|---|---|---|---|---|")
    for key, report in results.items():
        lines += [f"### {key}", "", header]
        for name, c in report["cases"].items():
            q = c["quality"]
            visual = q.get("draft visual tokens")
            peak = c["peak_memory_bytes"] / 2**20 if c["peak_memory_bytes"] else float("nan")
            mal = c["mean_accepted_length"]
            spread = 100 * c["iqr_s"] / c["median_s"] if c["median_s"] else float("nan")
            compression = c.get("ideal_speedup")
            lines.append(f"| {name} | {c['speedup']:.2f}x | {spread:.0f} % | {'-' if mal is None else f'{mal:.2f}'} | "
                         f"{'-' if compression is None else f'{compression:.2f}'} | "
                         f"{c['items_per_s']:.1f} | {'-' if visual is None else f'{visual:.0f}'} | {peak:.0f} | "
                         f"{q['accuracy']:.3f} |")
        lines += ["", f"Round breakdown ({BREAKDOWN_NOTE}):", "",
                  BenchmarkReport.from_dict(report).breakdown_markdown().rstrip(), ""]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, METHODS)
    parser.add_argument("--pipeline", default="mmspec/shapes-vlm", help="zoo id or pipeline folder")
    parser.add_argument("--hf-cases", nargs="*", default=list(HF_CASES), choices=list(HF_CASES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--examples", type=int, default=8, help="held-out examples per task")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    monitor = LoadMonitor()  # the machine's load over the whole run, recorded beside its table
    torch.set_num_threads(args.threads)
    cases = method_kwargs(args.methods, default_cases(), args.method_kwargs, derived_cases=True)

    from mmspec.pipelines import VLMPipeline

    pipe = load_quiet_pipeline(VLMPipeline, args.pipeline, cpu_gemm=args.cpu_gemm)
    for mode in args.modes:  # every case resolves before anything is timed: a bad case fails at once
        for batch in args.batch_sizes:
            for case, spec in cases.items():
                case_method(pipe, case, spec, MODES[mode], batch)
    hf_cases = [c for c in args.hf_cases if c != "hf_assisted" or pipe.draft_model is not None]
    results = run(pipe, args.methods, cases, args.modes, args.tasks, args.batch_sizes, args.examples,
                  args.max_new_tokens, args.repeats, args.seed, hf_cases)
    meta = {"machine": machine_line(cpu_gemm=args.cpu_gemm), "examples": args.examples, "repeats": args.repeats,
            "max_new_tokens": args.max_new_tokens, "cases": cases}
    table = to_markdown(results, command_line("mmspec.evaluation.bench_vlm", argv), meta)
    write_report(args.out, table, {"meta": meta, "results": results}, load=monitor.stop(), force=args.force_contended)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
