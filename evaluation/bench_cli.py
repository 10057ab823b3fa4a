"""What every pipeline benchmark's command line shares: the run options (repeats, seed, threads, output),
the methods list with its baseline first and per-method keyword overrides (JSON), the machine line, the
command line quoted into the table, and writing the markdown table with a JSON file of all numbers beside
it."""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from mmspec.cpu_gemm import add_cpu_gemm_argument
from mmspec.devices import add_device_arguments, load_pipeline, resolved_device

from .files import write_json_atomic, write_text_atomic
from .speed import MachineLoad


def new_parser(description: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser: ``description`` (the module docstring) printed as written by ``--help``."""
    return argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)


def load_quiet_pipeline(pipeline_class: type, path: str, dtype: torch.dtype | None = None,
                        cpu_gemm: str = "plain", device: str | torch.device | None = None) -> Any:
    """``pipeline_class.from_pretrained(path)`` (a zoo id or folder) on ``device`` with its progress bar off:
    the benchmarks and diagnostics time or print their own results. ``dtype``: the components' compute
    precision (None: the pipeline's own, float32 compute for the zoo); ``cpu_gemm``: ``"packed"`` or
    ``"plain"`` (:data:`mmspec.cpu_gemm.CPU_GEMM_MODES`); ``device``: None for the machine's default (CUDA
    when torch sees a GPU)."""
    pipe = load_pipeline(pipeline_class, path, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    pipe.set_cpu_gemm(cpu_gemm)
    return pipe


def load_bench_pipeline(pipeline_class: type, args: argparse.Namespace) -> Any:
    """The benchmark's pipeline as its command line asks: ``--pipeline`` on ``--device`` in ``--dtype``, with
    ``--cpu-gemm`` (the options :func:`add_run_arguments` declares)."""
    return load_quiet_pipeline(pipeline_class, args.pipeline, args.dtype, args.cpu_gemm, resolved_device(args))


def add_run_arguments(parser: argparse.ArgumentParser,
                      out_help: str = "markdown table (a .json with all numbers beside it)") -> None:
    """``--repeats``, ``--seed``, ``--threads``, ``--device``, ``--dtype``, ``--cpu-gemm`` and ``--out``: the
    options every pipeline benchmark has, whatever it calls its cases."""
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per case (the median is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    add_device_arguments(parser, dtype_help="compute precision of every method, the baseline included (float32 "
                                            "or bfloat16)")
    add_cpu_gemm_argument(parser)
    parser.add_argument("--out", type=Path, default=None, help=out_help)
    parser.add_argument("--force-contended", action="store_true",
                        help="write a table under docs/ although other processes used the CPU during the run "
                             "(it is then marked contended); by default such a run is refused there")


def add_common_arguments(parser: argparse.ArgumentParser, methods: Sequence[str]) -> None:
    """``--methods`` (default ``methods``, baseline first), ``--method-kwargs``, then
    :func:`add_run_arguments`: the options of a benchmark whose cases are methods."""
    parser.add_argument("--methods", nargs="+", default=list(methods))
    parser.add_argument("--method-kwargs", default="{}", help="JSON {method: {pipeline kwarg: value}} overrides")
    add_run_arguments(parser)


def method_kwargs(methods: Sequence[str], defaults: Mapping[str, dict], overrides: str,
                  baseline: str = "none", derived_cases: bool = False) -> dict[str, dict]:
    """Per-method pipeline keywords: ``defaults[m]`` updated by the JSON ``overrides`` ``{method: {...}}``.

    With ``derived_cases`` (a benchmark whose cases carry their pipeline method in a ``"method"`` key) a
    case not in ``defaults`` may be defined in ``overrides`` with ``"like": CASE``: ``CASE``'s keywords
    and pipeline method, updated by the rest, e.g. ``{"eagle, K=4": {"like": "eagle", "num_draft_tokens":
    4}}``, so variants of one method run side by side under their own names (variants of the baseline
    too, timed against the baseline like any other case). Raises ``SystemExit`` with a
    clear message when the baseline is not first, a method is unknown or the JSON is malformed
    (command-line errors)."""
    if not methods or methods[0] != baseline:
        raise SystemExit(f"--methods must start with {baseline} (the baseline every speedup is measured against)")
    try:
        parsed = json.loads(overrides)
    except json.JSONDecodeError as error:
        raise SystemExit(f"--method-kwargs is not valid JSON: {error}") from None
    if not isinstance(parsed, dict) or not all(isinstance(v, dict) for v in parsed.values()):
        raise SystemExit("--method-kwargs must be a JSON object {method: {keyword: value}}")
    out = {}
    for m in methods:
        override = dict(parsed.get(m, {}))
        like = override.pop("like", None) if derived_cases else None
        if m in defaults and like is None:
            out[m] = {**defaults[m], **override}
        elif like in defaults:  # a variant of the baseline too, e.g. target-only in another precision
            out[m] = {**defaults[like], "method": defaults[like].get("method", like), **override}
        else:
            hint = ' (or define it in --method-kwargs with {"like": CASE, ...})' if derived_cases else ""
            what = f"'like' case {like!r} of {m!r}" if like is not None else f"methods [{m!r}]"
            raise SystemExit(f"unknown {what}; choose from {list(defaults)}{hint}")
    return out


def call_kwargs(kwargs: Mapping[str, Any], greedy: bool = False) -> dict[str, Any]:
    """Pipeline keywords from a benchmark's JSON-able ones: a ``"tree"`` given as a dict
    (``{"depth": 8, "top_k": 3, "total_tokens": 16}``) becomes a :class:`~mmspec.drafters.TreeConfig`, so
    trees can be benchmarked from the command line (``--method-kwargs '{"eagle": {"tree": {...}}}'``);
    ``"rule": "exact"`` becomes the core's exact rule (:class:`~mmspec.rules.GreedyRule` when ``greedy``,
    else :class:`~mmspec.rules.ExactRule`), e.g. to run a lossy method's drafter losslessly."""
    from mmspec.drafters import TreeConfig
    from mmspec.rules import ExactRule, GreedyRule

    out = dict(kwargs)
    if "rule" in out and isinstance(out["rule"], str):
        if out["rule"] != "exact":
            raise SystemExit(f"--method-kwargs: rule must be \"exact\" (the only rule named by string), got {out['rule']!r}")
        out["rule"] = GreedyRule() if greedy else ExactRule()
    if isinstance(out.get("tree"), Mapping):
        try:
            out["tree"] = TreeConfig(**out["tree"])
        except TypeError as error:
            raise SystemExit(f"--method-kwargs: bad tree {dict(out['tree'])}: {error}") from None
    return out


def machine_line(dtype: torch.dtype | None = None, cpu_gemm: str = "plain",
                 device: str | torch.device | None = None) -> str:
    """``"x86_64, 2 threads, torch 2.13.0+cpu"`` (on a GPU: ``"NVIDIA H200, torch 2.13.0"``): where the numbers
    were measured (``", bfloat16"`` appended for a run in another precision than float32, ``", packed oneDNN
    GEMM"`` for ``--cpu-gemm packed``)."""
    if device is not None and torch.device(device).type == "cuda":
        line = f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    else:
        line = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    if dtype not in (None, torch.float32):
        line += f", {str(dtype).removeprefix('torch.')}"
    return line + ", packed oneDNN GEMM" if cpu_gemm == "packed" else line


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run (quoted into the table), arguments shell-quoted so that it can
    be pasted as is (case names with spaces, JSON keywords)."""
    return f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)


#: folders (relative to the repository root) whose tables are published: a contended run may not write there
PUBLISHED_FOLDERS = ("docs",)
#: the checkout this package runs from (an editable install: the repository)
REPOSITORY = Path(__file__).resolve().parents[1]


def is_published(path: Path) -> bool:
    """Whether ``path`` is a published table of this repository (under docs/, or the README)."""
    resolved = Path(path).resolve()
    if resolved == REPOSITORY / "README.md":
        return True
    return any(resolved.is_relative_to(REPOSITORY / folder) for folder in PUBLISHED_FOLDERS)


def check_publishable(out: Path | None, load: MachineLoad, force: bool = False) -> None:
    """Refuse (SystemExit) a contended or unmeasured run's table for the repository's docs unless ``force``:
    figures measured beside other work overstate speedups here (see :mod:`mmspec.evaluation.speed`)."""
    if out is None or not is_published(out) or load.contended is False or force:
        return
    raise SystemExit(f"refusing to write {out}: the run was not quiet ({load.describe()}). Published figures "
                     "come from a machine with nothing else running; rerun there, write elsewhere, or pass "
                     "--force-contended (the table then says it was contended).")


def write_report(out: Path | None, table: str, payload: Any, load: MachineLoad, force: bool = False) -> None:
    """Print the markdown ``table`` with a line on the machine's ``load``; with ``out``, write both there and
    ``payload`` (with the load) as JSON beside it (``out`` with a ``.json`` suffix), both atomically.

    A table for the repository's docs (:func:`is_published`) must come from a quiet run
    (:func:`check_publishable`); ``force`` writes a contended one, marked as such in its first line."""
    check_publishable(out, load, force)
    table = f"{table.rstrip()}\n\nMachine load: {load.describe()}.\n"
    if load.contended is not False:
        table = (f"**Measured on a {'contended' if load.contended else 'possibly busy'} machine**: other "
                 "processes ran beside the benchmark, which slows every forward and overstates speedups.\n\n"
                 + table)
    print(table)
    if out is None:
        return
    if isinstance(payload, dict):
        payload = {**payload, "load": asdict(load)}
    write_text_atomic(out, table)
    write_json_atomic(out.with_suffix(".json"), payload, indent=1, default=str)


def resolve_case_method(pipe: Any, case: str, method: str, fields: Mapping[str, Any], base: Callable[[], Any], *,
                        reference: bool = False, option: str = "--method-kwargs", keys: Sequence[str] = (),
                        hint: Callable[[str], str] | None = None) -> Any:
    """The ``method=`` a benchmark case runs, resolved as a user's call would be: the method's name when the
    case sets no config field and is not a reference row (the checkpoint's stored settings), else ``base()``
    (the stored config for the case's mode and batch, or a reference config) with ``fields`` replaced.

    Command-line errors exit naming ``option``: a method the pipeline lacks, config fields on target-only
    decoding, a key that is neither a field of the config nor one of ``keys`` (``hint(key)``: extra advice),
    a value the config refuses."""
    if method != "none" and method not in pipe.methods():
        raise SystemExit(f"{option}: case {case!r} names method {method!r}; methods: {pipe.methods()}")
    if method == "none" or not (fields or reference):
        if fields:
            raise SystemExit(f"{option}: case {case!r} runs target-only decoding, which has no settings; got "
                             f"{sorted(fields)}")
        return method
    config = base()
    unknown = [key for key in fields if key not in config.field_names()]
    if unknown:
        raise SystemExit(f"{option}: case {case!r} sets {unknown[0]!r}, which is neither a field of "
                         f"{type(config).__name__} ({', '.join(config.field_names())}) nor a case key "
                         f"({', '.join(keys)}){hint(unknown[0]) if hint else ''}")
    try:
        return type(config).from_dict({**config.to_dict(), **fields}, source=f"case {case!r}")
    except ValueError as error:
        raise SystemExit(f"{option}: {error}") from None


def reference_of(table: Mapping[str, Any], case: str, method: str) -> Any:
    """``table[method]`` (a benchmark's reference settings), exiting with a clear message when it has none."""
    if method not in table:
        raise SystemExit(f"case {case!r}: no reference settings for {method!r} (the benchmark has them for "
                         f"{list(table)})")
    return table[method]
