"""The ``mmspec demo`` command: serve the Gradio demo (gradio is imported only when the command runs).

    mmspec demo                                    # http://127.0.0.1:7860 on the bundled zoo, offline
    mmspec demo --vlm /ckpt/llava-eagle --ar-image /ckpt/llamagen-t2i --port 8000
    mmspec demo --tiny /tmp/mmspec-tiny            # tiny random pipelines for families without a checkpoint
    mmspec demo --device cuda --dtype bfloat16     # on the GPU (the default when torch sees one)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from mmspec.cpu_gemm import add_cpu_gemm_argument
from mmspec.devices import add_device_arguments, resolved_device

FLAGS = {"vlm": "--vlm", "ar_image": "--ar-image", "continuous": "--continuous", "video": "--video"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes the demo)")
    parser.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    parser.add_argument("--vlm", metavar="PATH", help="VLM pipeline folder or zoo id (default mmspec/shapes-vlm)")
    parser.add_argument("--ar-image", metavar="PATH",
                        help="AR image pipeline folder or zoo id (default mmspec/shapes-t2i)")
    parser.add_argument("--continuous", metavar="PATH",
                        help="continuous AR image pipeline folder or zoo id (default mmspec/shapes-t2i-continuous)")
    parser.add_argument("--video", metavar="PATH", help="AR video pipeline folder or zoo id (default mmspec/shapes-video)")
    parser.add_argument("--tiny", metavar="DIR",
                        help="build tiny RANDOM pipelines in DIR and use them for every family not given above "
                             "(noise outputs: for trying the page where no checkpoint exists)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_device_arguments(parser)
    add_cpu_gemm_argument(parser)


def paths_from_args(args: argparse.Namespace) -> dict[str, str]:
    """``{family: path}`` from the flags (families left out use their zoo id), tiny pipelines filling in
    the rest when ``--tiny`` is given."""
    paths = {family: getattr(args, flag.lstrip("-").replace("-", "_")) for family, flag in FLAGS.items()}
    paths = {family: path for family, path in paths.items() if path}
    if args.tiny:
        from mmspec.demos.tiny import FAMILIES, build_tiny_pipelines

        missing = tuple(f for f in FAMILIES if f not in paths)
        if missing:
            print(f"building tiny random pipelines for {', '.join(missing)} in {args.tiny} ...", flush=True)
            paths.update(build_tiny_pipelines(args.tiny, missing))
    return paths


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("gradio") is None:
        print("mmspec demo needs gradio, an optional extra: pip install \"mmspec[demo]\" "
              "(or bash scripts/setup.sh, which installs it)", file=sys.stderr)
        return 1
    if not 1 <= args.port <= 65535:
        print(f"--port must be in [1, 65535], got {args.port}", file=sys.stderr)
        return 2
    if args.threads is not None:
        import torch

        if args.threads < 1:
            print(f"--threads must be a positive integer, got {args.threads}", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    print("mmspec demo: starting (importing gradio and the pipelines, then loading models; 10-40 s) ...", flush=True)
    from mmspec.demos.app import launch
    from mmspec.demos.common import PipelineCache

    paths = paths_from_args(args)
    device = resolved_device(args)
    print(f"mmspec demo on http://{args.host}:{args.port} ({device}, {str(args.dtype).removeprefix('torch.')}; "
          "Ctrl+C stops it)", flush=True)
    launch(paths, host=args.host, port=args.port, block=True,
           cache=PipelineCache(device=device, dtype=args.dtype, cpu_gemm=args.cpu_gemm))
    return 0
