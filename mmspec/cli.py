"""The ``mmspec`` command line.

``mmspec --version`` prints the installed version. Sub-commands:
    mmspec info      versions, kernel backend and which pipelines this install provides
    mmspec generate  images from prompts with ARImagePipeline (speculative vs target-only, PNGs, speedup)
    mmspec demo      the Gradio demo, one tab per pipeline family (gradio: the optional `demo` extra)
"""

from __future__ import annotations

import argparse
import importlib
import sys


def _info(_: argparse.Namespace) -> int:
    import torch

    import mmspec
    from mmspec import kernels

    probe = torch.zeros(1, device="cuda") if torch.cuda.is_available() else torch.zeros(1)
    print(f"mmspec {mmspec.__version__}")
    print(f"torch {torch.__version__} (cuda available: {torch.cuda.is_available()})")
    print(f"triton importable: {kernels.triton_available()}; kernel backend here: {kernels.kernel_backend(probe)}")
    pipelines = importlib.import_module("mmspec.pipelines")
    names = ("VLMPipeline", "ARImagePipeline", "ContinuousARImagePipeline", "ARVideoPipeline")
    for name in names:
        print(f"{name}: {'available' if hasattr(pipelines, name) else 'not in this version'}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from mmspec.pipelines.generate_cli import run

    return run(args)


def _demo(args: argparse.Namespace) -> int:
    from mmspec.demos.launch import run  # imports gradio only when the page starts

    return run(args)


# name -> (help, module whose ``add_arguments(parser)`` declares the command's options, or None). A command's
# module is imported only when that command runs, so `mmspec --version` and `mmspec info` never import the
# pipelines, diffusers or gradio.
COMMANDS = {
    "info": ("show versions, kernel backend and available pipelines", None),
    "generate": ("generate images from prompts (discrete AR image pipeline)", "mmspec.pipelines.generate_cli"),
    "demo": ("serve the Gradio demo on 127.0.0.1 (every pipeline, speculative vs target-only)", "mmspec.demos.launch"),
}
RUNNERS = {"info": _info, "generate": _generate, "demo": _demo}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``mmspec`` parser; only ``command``'s options are declared (the others are listed by name)."""
    from mmspec import __version__

    parser = argparse.ArgumentParser(prog="mmspec", description="Speculative decoding for multimodal models.")
    parser.add_argument("--version", action="version", version=f"mmspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, module) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        if name == command and module is not None:
            importlib.import_module(module).add_arguments(sub)
        sub.set_defaults(run=RUNNERS[name])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
