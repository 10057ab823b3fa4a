"""Benchmark of an exported mmspec head on vLLM: offline API and ``vllm serve`` over HTTP, with and without it.

Runs in the vLLM environment (docs/vllm.md)::

    .venv-vllm/bin/python -m mmspec.evaluation.bench_vllm --out docs/benchmarks/vllm_cpu.md

Default workload: the zoo VLM (``mmspec/shapes-vlm``, converted for vLLM) with its trained EagleVLM head
exported, held-out "describe" images, greedy, ``--max-tokens`` tokens per request. ``--target`` / ``--head``
(an exported head) / ``--chat-template`` run another pair; ``--text-prompts`` sends plain text prompts
instead of the zoo's images.

For each of "offline" (``LLM.chat``) and "serve" (``vllm serve`` + the OpenAI client, chat completions)
and each of no head / the head, at each concurrency c (default 1, 8, 32), ``--num-prompts`` requests are
sent with at most c in flight (offline: ``chat`` on batches of c). Both modes send the same chat messages,
rendered by the same template, so they decode the same prompt tokens: ``--chat-template``, else the one
``python -m mmspec.integrations.vllm serve`` serves the target with (its own, with BOS written where its
tokenizer needs it).
Columns: output tokens/s
(completion tokens over the level's wall time), mean acceptance length (1 + accepted / drafts from vLLM's
``vllm:spec_decode_*`` counters over that level: tokens per target forward), and request latency p50 / p90
/ p99 (serve only: the offline API returns a batch at once). Each (mode, head) pair starts vLLM once
(``--enforce-eager``; start-up is not timed).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from mmspec.integrations.vllm.offline import REPLY_PREFIX, chat_messages, parse_reply

from .bench_cli import check_publishable
from .speed import LoadMonitor

DEFAULT_CONCURRENCY = (1, 8, 32)
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")


# ----------------------------------------------------------------------------------------------------------
# Workload
# ----------------------------------------------------------------------------------------------------------
def prepare_zoo(work: Path, k: int) -> tuple[Path, Path]:
    """The zoo VLM converted for vLLM (its chat template included) and its EagleVLM head exported."""
    import mmspec.models.zoo as zoo_package
    from mmspec.integrations.vllm import ExportOptions, export_head
    from mmspec.integrations.vllm.convert import convert_llava_for_vllm

    zoo = Path(zoo_package.__file__).resolve().parent / "shapes-vlm"
    target = convert_llava_for_vllm(zoo / "target", work / "target", zoo / "processor" / "chat_template.jinja")
    head = export_head(zoo / "eagle_head", target, work / "head", ExportOptions(num_speculative_tokens=k))
    return target, head


def zoo_requests(count: int) -> list[dict[str, Any]]:
    """``count`` held-out "describe" examples: instruction text and PNG bytes."""
    from PIL import Image

    from mmspec.models import shapes_vlm as sv

    requests = []
    for index in range(count):
        example = sv.image_example("test", 0, index, "describe")
        buffer = io.BytesIO()
        Image.fromarray(example["frames"][0]).save(buffer, format="PNG")
        requests.append({"text": sv.INSTRUCTIONS["describe"], "png": buffer.getvalue()})
    return requests


def text_requests(count: int) -> list[dict[str, Any]]:
    words = ["a small red circle", "two shapes", "the image shows", "a large blue square"]
    return [{"text": words[i % len(words)], "png": None} for i in range(count)]


def latency_percentiles(latencies: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 of the requests' latencies in seconds (NaN without requests)."""
    if not latencies:
        return {"p50_s": float("nan"), "p90_s": float("nan"), "p99_s": float("nan")}
    p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
    return {"p50_s": float(p50), "p90_s": float(p90), "p99_s": float(p99)}


def acceptance(before: dict[str, float], after: dict[str, float]) -> float | None:
    drafts = after.get(SPEC_COUNTERS[0], 0) - before.get(SPEC_COUNTERS[0], 0)
    accepted = after.get(SPEC_COUNTERS[1], 0) - before.get(SPEC_COUNTERS[1], 0)
    return None if drafts <= 0 else 1.0 + accepted / drafts


# ----------------------------------------------------------------------------------------------------------
# Offline API (one process per (target, head): vLLM's engine is not restarted within a process)
# ----------------------------------------------------------------------------------------------------------
def offline_worker(config: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams

    from mmspec.integrations.vllm.launch import speculative_config, target_overrides

    kwargs: dict[str, Any] = {}
    if config["head"]:
        kwargs["speculative_config"] = speculative_config(config["target"], config["head"], config["k"])
        kwargs["hf_overrides"] = target_overrides(config["target"]) or None
    llm = LLM(model=config["target"], dtype=config["dtype"], enforce_eager=config["enforce_eager"], seed=0,
              disable_log_stats=False, max_num_seqs=max(config["concurrency"]), **kwargs)
    requests = zoo_requests(config["num_prompts"]) if not config["text_prompts"] else text_requests(config["num_prompts"])
    params = SamplingParams(temperature=0.0, max_tokens=config["max_tokens"], ignore_eos=True)
    template = Path(config["chat_template"]).read_text() if config["chat_template"] else None
    prompts = [chat_messages(r["text"], r["png"]) for r in requests]

    def generate(batch: list[Any]) -> list[Any]:
        return llm.chat(batch, params, use_tqdm=False, chat_template=template)

    generate(prompts[:2])  # warm-up
    rows = []
    for c in config["concurrency"]:
        before = _counters(llm.get_metrics())
        start = time.perf_counter()
        tokens = 0
        for at in range(0, len(prompts), c):
            tokens += sum(len(o.outputs[0].token_ids) for o in generate(prompts[at:at + c]))
        wall = time.perf_counter() - start
        rows.append({"mode": "offline", "head": bool(config["head"]), "concurrency": c, "requests": len(prompts),
                     "output_tokens": tokens, "tokens_per_s": tokens / wall,
                     "mean_acceptance_length": acceptance(before, _counters(llm.get_metrics())),
                     "p50_s": None, "p90_s": None, "p99_s": None})
    return rows


def _counters(metrics: list[Any]) -> dict[str, float]:
    return {m.name: float(m.value) for m in metrics if m.name in SPEC_COUNTERS}


def chat_template_file(args: argparse.Namespace, target: Path, work: Path) -> Path | None:
    """``--chat-template``, else the template ``serve`` would add for ``target`` (written to ``work``), else None
    (the target's own)."""
    from mmspec.integrations.vllm.launch import serving_chat_template

    if args.chat_template is not None:
        return args.chat_template
    template = serving_chat_template(target, [])
    if template is None:
        return None
    path = work / "chat_template.jinja"
    path.write_text(template)
    return path


def run_offline(args: argparse.Namespace, target: Path, head: Path | None, template: Path | None,
                work: Path) -> list[dict[str, Any]]:
    config = {"target": str(target), "head": str(head) if head else None, "k": args.k, "max_tokens": args.max_tokens,
              "num_prompts": args.num_prompts, "concurrency": list(args.concurrency), "text_prompts": args.text_prompts,
              "dtype": args.dtype, "enforce_eager": args.enforce_eager,
              "chat_template": str(template) if template else None}
    path = work / f"offline-{'head' if head else 'plain'}.json"
    path.write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "mmspec.evaluation.bench_vllm", "--offline-worker", str(path)],
                          cwd=work, env=_env(args), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"offline run failed:\n{done.stderr[-3000:]}")
    return parse_reply(done.stdout)


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if args.threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    return env


# ----------------------------------------------------------------------------------------------------------
# vllm serve + OpenAI client
# ----------------------------------------------------------------------------------------------------------
def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in SPEC_COUNTERS:
            if line.startswith(name + "_total"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _wait_ready(port: int, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with status {server.returncode} (see its log)")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"vllm serve was not ready after {timeout:.0f} s")


async def _level(port: int, model: str, requests: list[dict[str, Any]], concurrency: int,
                 max_tokens: int) -> tuple[list[float], int, float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600, max_retries=0)
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0

    async def one(request: dict[str, Any]) -> None:
        nonlocal tokens
        async with gate:
            start = time.perf_counter()
            reply = await client.chat.completions.create(model=model, messages=chat_messages(request["text"], request["png"]), temperature=0.0,
                                                         max_tokens=max_tokens,
                                                         extra_body={"ignore_eos": True})
            latencies.append(time.perf_counter() - start)
            tokens += reply.usage.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(one(r) for r in requests))
    wall = time.perf_counter() - start
    await client.close()
    return latencies, tokens, wall


def run_serve(args: argparse.Namespace, target: Path, head: Path | None, template: Path | None,
              work: Path) -> list[dict[str, Any]]:
    from mmspec.integrations.vllm.launch import serve_command, speculative_config

    options = ["--port", str(args.port), "--host", "127.0.0.1", "--dtype", args.dtype, "--seed", "0",
               "--max-num-seqs", str(max(args.concurrency)), "--served-model-name", "bench"]
    if args.enforce_eager:
        options.append("--enforce-eager")
    if template is not None:
        options += ["--chat-template", str(template)]
    command = serve_command(target, speculative_config(target, head, args.k) if head is not None else None, options)
    log = (work / f"serve-{'head' if head else 'plain'}.log").open("w")
    server = subprocess.Popen(command, cwd=work, env=_env(args), stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        _wait_ready(args.port, server, args.start_timeout)
        requests = zoo_requests(args.num_prompts) if not args.text_prompts else text_requests(args.num_prompts)
        asyncio.run(_level(args.port, "bench", requests[:2], 2, args.max_tokens))  # warm-up
        rows = []
        for c in args.concurrency:
            before = _scrape(args.port)
            latencies, tokens, wall = asyncio.run(_level(args.port, "bench", requests, c, args.max_tokens))
            rows.append({"mode": "serve", "head": head is not None, "concurrency": c, "requests": len(requests),
                         "output_tokens": tokens, "tokens_per_s": tokens / wall,
                         "mean_acceptance_length": acceptance(before, _scrape(args.port)),
                         **latency_percentiles(latencies)})
        return rows
    finally:
        _stop(server)
        log.close()


def _stop(server: subprocess.Popen) -> None:
    """Stop the server and every process it started (its own session)."""
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]]) -> str:
    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| mode | head | concurrency | requests | output tok/s | speedup | mean acceptance length | "
             "p50 s | p90 s | p99 s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    plain = {(r["mode"], r["concurrency"]): r["tokens_per_s"] for r in rows if not r["head"]}
    for r in rows:
        base = plain.get((r["mode"], r["concurrency"]))
        speedup = None if base is None else r["tokens_per_s"] / base
        lines.append(f"| {r['mode']} | {'mmspec EagleVLM' if r['head'] else 'none'} | {r['concurrency']} | "
                     f"{r['requests']} | {r['tokens_per_s']:.1f} | {number(speedup, 2)} | "
                     f"{number(r['mean_acceptance_length'], 2)} | {number(r['p50_s'], 2)} | {number(r['p90_s'], 2)} | "
                     f"{number(r['p99_s'], 2)} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=None, help="vLLM-loadable target (default: the zoo VLM)")
    parser.add_argument("--head", type=Path, default=None, help="exported head (default: the zoo's EagleVLM head)")
    parser.add_argument("--chat-template", type=Path, default=None)
    parser.add_argument("--text-prompts", action="store_true", help="plain text prompts instead of zoo images")
    parser.add_argument("--modes", nargs="+", default=["offline", "serve"], choices=("offline", "serve"))
    parser.add_argument("--concurrency", nargs="+", type=int, default=list(DEFAULT_CONCURRENCY))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--dtype", default="float32", help="vLLM's --dtype (bfloat16 on a GPU)")
    parser.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false",
                        help="let vLLM compile and capture CUDA graphs (GPU); the default runs eagerly (CPU)")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--threads", type=int, default=0, help="CPU cores vLLM binds (0: vLLM's default)")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--work", type=Path, default=None, help="folder for converted models and logs")
    parser.add_argument("--out", type=Path, default=None, help="write the table (Markdown) and rows (JSON beside)")
    parser.add_argument("--offline-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any(c <= 0 for c in args.concurrency) or args.num_prompts <= 0 or args.max_tokens <= 0:
        parser.error("--concurrency, --num-prompts and --max-tokens must be positive")
    if (args.target is None) != (args.head is None):
        parser.error("--target and --head go together (default: the zoo VLM and its exported head)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.offline_worker is not None:
        print(REPLY_PREFIX + json.dumps(offline_worker(json.loads(args.offline_worker.read_text()))), flush=True)
        return 0
    monitor = LoadMonitor()  # vLLM's engine and server processes count as this run's own work
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    target, head = prepare_zoo(work, args.k) if args.target is None else (args.target, args.head)
    template = chat_template_file(args, target, work)
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        for with_head in (None, head):
            run = run_offline if mode == "offline" else run_serve
            rows += run(args, target, with_head, template, work)
            print(table(rows), flush=True)
    load = monitor.stop()
    print(f"Machine load: {load.describe()}.")
    if args.out is not None:
        check_publishable(args.out, load)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"{table(rows)}\n\nMachine load: {load.describe()}.\n")
        args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "load": asdict(load)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":  # vLLM starts worker processes: only the main process may run this
    sys.exit(main())
