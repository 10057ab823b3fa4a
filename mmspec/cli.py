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


def build_parser() -> argparse.ArgumentParser:
    from mmspec import __version__

    parser = argparse.ArgumentParser(prog="mmspec", description="Speculative decoding for multimodal models.")
    parser.add_argument("--version", action="version", version=f"mmspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="show versions, kernel backend and available pipelines").set_defaults(run=_info)
    generate = commands.add_parser("generate", help="generate images from prompts (discrete AR image pipeline)")
    from mmspec.pipelines.generate_cli import add_arguments  # the pipelines package defines its own options

    add_arguments(generate)
    generate.set_defaults(run=_generate)
    demo = commands.add_parser("demo", help="serve the Gradio demo on 127.0.0.1 (every pipeline, speculative vs "
                                            "target-only)")
    from mmspec.demos.launch import add_arguments as add_demo_arguments  # no gradio import here

    add_demo_arguments(demo)
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
