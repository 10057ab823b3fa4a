"""What a target's prefill keeps in memory: last-slot logits and hooked hidden states vs the naive way.

A speculative-decoding loop reads one row of a prefill's logits (the last slot's) and at most two of its
hidden states per slot (the top one for EAGLE-style heads, the penultimate one for SpecVLM's gate). The
naive prefill, what ``output_hidden_states=True`` without ``logits_to_keep`` gives, materialises logits for
every prompt slot (``T x V`` floats: a 4,096-token video prompt of a 152k-vocabulary model is 2.5 GB in
fp32) and every layer's output (``(L + 1) x T x D``). :class:`~mmspec.runner.CausalLMRunner` and
:class:`~mmspec.models.vlm_targets.VLMRunner` avoid both by default (``prefill_logits="last"``,
``read_hidden="hooks"``). This script measures the difference on a random Qwen2-VL (transformers'
``Qwen2VLForConditionalGeneration``, text-only prompt: the language model is where both savings are; the
vision tower's activations are the same either way): for each setting it runs one ``VLMRunner.prefill``
with the top and penultimate hidden states in a fresh subprocess and reports the peak resident memory
above the loaded model and the wall time. Outputs are checked equal across settings (last-slot logits
and both hidden states).

    python -m mmspec.evaluation.prefill_memory [--tokens 2048] [--vocab 152064] [--hidden 512] [--layers 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

#: (prefill_logits, read_hidden) settings, the runners' defaults first
SETTINGS = [("last", "hooks"), ("last", "output_hidden_states"), ("all", "hooks"), ("all", "output_hidden_states")]


def build_model(vocab: int, hidden: int, layers: int, seed: int = 0) -> Any:
    """A random ``Qwen2VLForConditionalGeneration`` (fp32, eval mode) with a small vision tower."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    heads = max(1, hidden // 64)
    config = Qwen2VLConfig(
        text_config={"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 4 * hidden,
                     "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4),
                     "max_position_embeddings": 32768, "tie_word_embeddings": False,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}},  # heads of width 64
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": hidden, "num_heads": 2, "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=vocab - 3, video_token_id=vocab - 2, vision_start_token_id=vocab - 1)
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config).eval()


def _rss_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status (this measurement needs Linux)")


def measure_one(args: argparse.Namespace, prefill_logits: str, read_hidden: str) -> dict[str, Any]:
    """Run one prefill in this process; peak RSS above the loaded model, seconds, and output checksums."""
    from mmspec.models.vlm_targets import VLMRunner

    torch.set_num_threads(args.threads)
    model = build_model(args.vocab, args.hidden, args.layers, args.seed)
    ids = torch.randint(0, args.vocab - 3, (1, args.tokens), generator=torch.Generator().manual_seed(args.seed))
    runner = VLMRunner(model, return_hidden=True, return_penultimate=True, prefill_logits=prefill_logits,
                       read_hidden=read_hidden)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _rss_bytes("VmRSS")
    start = time.perf_counter()
    out = runner.prefill(ids)
    seconds = time.perf_counter() - start
    peak = _rss_bytes("VmHWM")
    return {"prefill_logits": prefill_logits, "read_hidden": read_hidden, "peak_mib": (peak - before) / 2**20,
            "seconds": seconds, "logits_shape": list(out.logits.shape),
            "last_logits": out.logits[0, -1, :64].tolist(), "hidden_sum": float(out.hidden.double().sum()),
            "penultimate_sum": float(out.penultimate.double().sum())}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every setting in its own subprocess (a clean peak), each checked against the first."""
    rows = []
    for prefill_logits, read_hidden in SETTINGS:
        command = [sys.executable, "-m", "mmspec.evaluation.prefill_memory", "--one", prefill_logits, read_hidden,
                   *[f"--{k}={getattr(args, k)}" for k in ("tokens", "vocab", "hidden", "layers", "threads", "seed")]]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    reference = rows[0]
    for row in rows[1:]:
        same = torch.allclose(torch.tensor(row["last_logits"]), torch.tensor(reference["last_logits"]), atol=1e-4)
        for key in ("hidden_sum", "penultimate_sum"):
            same = same and abs(row[key] - reference[key]) <= 1e-6 * max(1.0, abs(reference[key]))
        if not same:
            raise RuntimeError(f"setting {row['prefill_logits']}/{row['read_hidden']} returned other outputs than "
                               f"{reference['prefill_logits']}/{reference['read_hidden']}")
    return rows


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"Prefill of {args.tokens} tokens, random Qwen2-VL language model ({args.layers} layers, d={args.hidden}, "
             f"vocabulary {args.vocab}, fp32), top and penultimate hidden states, {args.threads} thread(s):", "",
             "| prefill logits | hidden states read by | logits returned | peak memory above the model | prefill time |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['prefill_logits']} | {row['read_hidden']} | {row['logits_shape']} | "
                     f"{row['peak_mib']:.0f} MiB | {row['seconds']:.2f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Peak memory of a target prefill: last-slot logits and hooked "
                                                 "hidden states against every slot's logits and every layer's output.")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length")
    parser.add_argument("--vocab", type=int, default=152064, help="vocabulary (Qwen2-VL's by default)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", nargs=2, metavar=("PREFILL_LOGITS", "READ_HIDDEN"),
                        help="measure one setting in this process and print it as JSON (used by the main run)")
    args = parser.parse_args(argv)
    for name in ("tokens", "vocab", "hidden", "layers", "threads"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    if args.hidden % 64:
        parser.error("--hidden must be a multiple of 64 (heads of width 64)")
    if args.one:
        print(json.dumps(measure_one(args, *args.one)))
        return
    print(markdown(run(args), args))


if __name__ == "__main__":
    main()
