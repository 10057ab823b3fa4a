"""Systems benchmark: how close each pipeline's speculative loop comes to its theoretical bound, at real sizes.

Every speed figure from the zoo comes from tiny models, where per-call overhead dominates. This benchmark
builds the real architectures (LlamaGen t2i L / XL, Janus-Pro-1B's generation path, LLaVA-1.5, Qwen2-VL-2B,
MAR-L with a MAR-B draft, a 1.3B causal video DiT) with random weights and their methods' real drafters
(:mod:`mmspec.evaluation.systems.specs`), and runs the pipelines' own loops with a controlled acceptance rate
alpha: the drafter runs as in the product, but the tokens it proposes are the target's greedy continuation,
each kept with probability alpha (:mod:`~mmspec.evaluation.systems.controlled`), so tau is known in advance
and efficiency can be measured without trained weights. Methods run with the settings a plain
``pipe(..., method=name)`` call gets (greedy, the row's batch).

    python -m mmspec.evaluation.bench_systems --systems llamagen-t2i-l --batches 1 4 --new-tokens 64 \\
        --threads 2 --out docs/benchmarks/systems_cpu.md
    python -m mmspec.evaluation.bench_systems --device cuda --dtype bfloat16 --out runs/systems_h200.md

Per row (system, method, alpha, batch): the target's forward time on 1 and on K+1 tokens, the drafter's time
per draft token, tau measured and expected, the measured speedup over target-only decoding in the same run
(median and range over ``--repeats``), the bound tau * T(1) / (T(K+1) + K * T_draft), the efficiency
(measured / bound), the loop's own time per round and the peak memory (see
:mod:`~mmspec.evaluation.systems.token_rows` and :mod:`~mmspec.evaluation.systems.block_rows` for the exact
definitions). Each system runs in a subprocess of its own (its memory is returned when it ends); rows whose
loop costs more than 5 % of a verification forward, or batch-1 chains below 0.9 of their bound, are
profiled with ``--profile``. Writes markdown, JSON beside it and (with matplotlib) a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from mmspec.cpu_gemm import add_cpu_gemm_argument
from mmspec.devices import add_device_arguments, resolved_device

from .bench_cli import command_line, machine_line, new_parser, write_report
from .speed import LoadMonitor
from .systems.specs import BLOCK_FAMILIES, SYSTEMS, SystemSpec, check_systems

ALPHAS = (0.5, 0.8, 0.95)
BATCHES = (1, 4, 16)
MODULE = "mmspec.evaluation.bench_systems"


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__)
    parser.add_argument("--systems", nargs="+", default=None,
                        help=f"architectures to run (default: the CPU set on a CPU, every full size on a GPU); "
                             f"choices: {', '.join(SYSTEMS)}")
    parser.add_argument("--methods", nargs="+", default=None, help="methods to run (default: each system's own)")
    parser.add_argument("--alphas", nargs="+", type=float, default=list(ALPHAS),
                        help="controlled acceptance rates, each in [0, 1]")
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES), help="batch sizes (rows per call)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens per row for AR-image and VLM systems (default: the system's: a whole image, "
                             "256 for VLMs); block systems generate whole images / their blocks")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per row (medians and ranges)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--profile", action="store_true",
                        help="profile (cProfile) rows whose loop exceeds 5 %% of a verification forward or whose "
                             "batch-1 chain reaches less than 0.9 of its bound")
    parser.add_argument("--in-process", action="store_true",
                        help="run every system in this process (default: one subprocess per system)")
    parser.add_argument("--out", type=Path, default=None, help="markdown report (JSON and PNG beside it)")
    parser.add_argument("--force-contended", action="store_true",
                        help="write a report under docs/ although other processes used the CPU during the run "
                             "(it is then marked contended)")
    parser.add_argument("--worker-json", type=Path, default=None, help=argparse.SUPPRESS)
    add_device_arguments(parser, dtype_help="precision of targets and drafters: float32 or bfloat16 (default float32)")
    add_cpu_gemm_argument(parser)
    return parser


def check_arguments(args: argparse.Namespace, device: torch.device) -> list[SystemSpec]:
    """The selected systems; ``ValueError`` naming the flag for anything out of range."""
    names = args.systems or [name for name, spec in SYSTEMS.items() if (spec.cpu if device.type == "cpu" else spec.gpu)]
    specs = check_systems(names)
    bad_alpha = [a for a in args.alphas if not 0.0 <= a <= 1.0]
    if bad_alpha:
        raise ValueError(f"--alphas must each be in [0, 1], got {bad_alpha[0]}")
    bad_batch = [b for b in args.batches if b < 1]
    if bad_batch:
        raise ValueError(f"--batches must be positive integers, got {bad_batch[0]}")
    if args.new_tokens is not None and args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be at least 2 (a prefill token and one round), got {args.new_tokens}")
    for spec in specs:
        limit = spec.config.get("block_size") or spec.config.get("grid", 0) ** 2
        if spec.family == "ar_image" and args.new_tokens is not None and args.new_tokens > limit:
            raise ValueError(f"--new-tokens={args.new_tokens} exceeds {spec.name}'s image of {limit} tokens")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be a positive integer, got {args.repeats}")
    if args.threads < 1:
        raise ValueError(f"--threads must be a positive integer, got {args.threads}")
    if args.methods:
        offered = {m for spec in specs for m in spec.methods}
        missing = [m for m in args.methods if m not in offered]
        if missing:
            raise ValueError(f"--methods: {missing[0]!r} is not run by the selected systems; their methods: "
                             f"{', '.join(sorted(offered))}")
    return specs


def _params(pipe: Any) -> dict[str, float]:
    return {name: sum(p.numel() for p in module.parameters()) / 1e6 for name, module in pipe.components.items()
            if isinstance(module, torch.nn.Module)}


def run_system(spec: SystemSpec, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Build ``spec`` and run its rows in this process."""
    from .systems.block_rows import block_rows
    from .systems.builders import build_system
    from .systems.token_rows import token_rows

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    system = build_system(spec, device, args.dtype, args.seed)
    if device.type == "cpu":
        system.pipe.set_cpu_gemm(args.cpu_gemm)
    build_s = time.perf_counter() - start
    methods = [m for m in spec.methods if not args.methods or m in args.methods]
    new_tokens = args.new_tokens or spec.new_tokens
    block = spec.family in BLOCK_FAMILIES
    per_batch = 1 + len(methods) * (1 if spec.family == "continuous" else len(args.alphas))
    load = [os.getloadavg()[0]]
    with tqdm(total=len(args.batches) * per_batch, desc=spec.name, leave=False) as progress:
        if block:
            rows = block_rows(system, methods, args.alphas, args.batches, args.repeats, args.seed, progress,
                              args.profile)
            configs = {r["method"]: r["config"] for r in rows if r["batch"] == min(args.batches)}
        else:
            rows = token_rows(system, methods, args.alphas, args.batches, new_tokens, args.repeats, args.seed,
                              progress, args.profile)
            configs = {r["method"]: r["config"] for r in rows if r["batch"] == min(args.batches)}
    load.append(os.getloadavg()[0])
    return {"spec": {"name": spec.name, "family": spec.family, "source": spec.source, "config": dict(spec.config),
                     "guidance_scale": spec.guidance_scale, "notes": list(spec.notes)},
            "params_m": _params(system.pipe), "build_s": build_s, "new_tokens": new_tokens, "load": load,
            "configs": configs, "rows": rows}


def worker_argv(args: argparse.Namespace, name: str, out: Path, device: torch.device) -> list[str]:
    """The command line of the subprocess that runs system ``name`` and writes its result to ``out``."""
    argv = [sys.executable, "-m", MODULE, "--systems", name, "--alphas", *map(str, args.alphas),
            "--batches", *map(str, args.batches), "--repeats", str(args.repeats), "--seed", str(args.seed),
            "--threads", str(args.threads), "--device", str(device),
            "--dtype", str(args.dtype).removeprefix("torch."), "--cpu-gemm", args.cpu_gemm, "--worker-json", str(out)]
    if args.methods:
        argv += ["--methods", *args.methods]
    if args.new_tokens is not None:
        argv += ["--new-tokens", str(args.new_tokens)]
    return argv + (["--profile"] if args.profile else [])


def run_in_subprocess(spec: SystemSpec, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        done = subprocess.run(worker_argv(args, spec.name, out, device))
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the subprocess running {spec.name} failed (exit code {done.returncode})")
        return json.loads(out.read_text())


def machine_state(device: torch.device, threads: int) -> str:
    """A sentence on the hardware the rows ran on (the machine's load over the run follows the table)."""
    if device.type == "cuda":
        return "One GPU, not shared."
    return f"{os.cpu_count() or 1} cores; {threads} torch threads."


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    monitor = LoadMonitor()  # the machine's load over the whole run, recorded beside its table
    device = resolved_device(args)
    try:
        specs = check_arguments(args, device)
    except ValueError as error:
        parser.error(str(error))
    if args.worker_json is not None:
        result = run_system(specs[0], args, device)
        args.worker_json.write_text(json.dumps(result, default=str))
        return 0
    results = [run_system(spec, args, device) if args.in_process else run_in_subprocess(spec, args, device)
               for spec in tqdm(specs, desc="systems")]
    from .systems.report import plot, to_markdown

    torch.set_num_threads(args.threads)
    machine = machine_line(args.dtype, args.cpu_gemm, device)
    table = to_markdown(results, command_line(MODULE, argv), machine, machine_state(device, args.threads))
    write_report(args.out, table, {"machine": machine, "results": results}, load=monitor.stop(), force=args.force_contended)
    if args.out is not None:
        plot(results, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
