"""Screenshot of the demo after a run, for the README (``docs/images/demo.png``).

    python -m mmspec.demos.screenshot --out docs/images/demo.png                 # AR image tab, bundled zoo
    python -m mmspec.demos.screenshot --tab vlm --tiny /tmp/tiny --out vlm.png   # tiny random pipelines
    python -m mmspec.demos.screenshot --tab video --runs 3 --out video.png       # is the speedup repeatable?

Serves the app on 127.0.0.1 (a free port), opens it in headless Chromium (:mod:`mmspec.demos.browser`),
runs the chosen tab with its default inputs (the checkpoint's stored method settings) and saves what a
1400x1000 window shows: Run and the result card in view. ``--runs N`` presses Run N times with the same
inputs first and prints each run's speedup and how far apart they are (the highest over the lowest).
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
from pathlib import Path

TABS = ("vlm", "ar_image", "continuous", "video")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def message_speedup(message: str) -> float | None:
    """The speedup a run's message states ("done: eagle ran 2.31x faster than the baseline", "2.9x slower"),
    None without one (a run whose timing was not trusted)."""
    if " as fast as " in message:
        return 1.0
    found = re.search(r"(\d+(?:\.\d+)?)x (faster|slower)", message)
    if found is None:
        return None
    value = float(found.group(1))
    return value if found.group(2) == "faster" else 1 / value


def spread_line(speedups: list[float | None]) -> str:
    """How far apart identical runs' speedups are: the highest over the lowest, minus one."""
    known = [s for s in speedups if s is not None]
    if len(known) < len(speedups):
        return f"{len(speedups) - len(known)} of {len(speedups)} runs had an untrusted timing (no speedup shown)"
    spread = max(known) / min(known) - 1
    return f"speedups {', '.join(f'{s:.2f}x' for s in known)}: the highest is {spread:.0%} above the lowest"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/images/demo.png"))
    parser.add_argument("--tab", choices=TABS, default="ar_image")
    parser.add_argument("--tiny", metavar="DIR", help="use tiny random pipelines for families without --path")
    parser.add_argument("--path", help="checkpoint of the chosen tab (default: its zoo id)")
    parser.add_argument("--prompt", default=None, help="prompt(s) to type, lines separated by \\n (default: the tab's)")
    parser.add_argument("--greedy", action="store_true", help="tick the tab's greedy box (VLM and AR image tabs)")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=1, help="identical runs before the screenshot (their speedups "
                        "are printed)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")

    import torch

    from mmspec.demos.app import launch
    from mmspec.demos.browser import open_browser, open_tab, run_and_wait, set_field, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"cannot take a screenshot: {reason}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    paths = {args.tab: args.path} if args.path else {}
    if args.tiny:
        from mmspec.demos.tiny import build_tiny_pipelines

        paths = {**build_tiny_pipelines(args.tiny, tuple(f for f in TABS if f not in paths)), **paths}
    app, url = launch(paths, port=free_port(), block=False, quiet=True)
    try:
        with open_browser(width=args.width, height=args.height) as page:
            page.goto(url)
            elem = open_tab(page, args.tab)
            if args.prompt is not None:
                set_field(page, f"{elem}-prompt", args.prompt.replace("\\n", "\n"))
            if args.greedy:
                page.locator(f"#{elem}-greedy input").check()
            speedups = []
            for run in range(args.runs):
                kind, message = run_and_wait(page, elem, timeout_s=600)
                if kind == "error":
                    print(f"the run failed: {message}", file=sys.stderr)
                    return 1
                speedups.append(message_speedup(message))
                print(f"run {run + 1}: {message}")
            if args.runs > 1:
                print(spread_line(speedups))
            page.wait_for_timeout(500)  # images finish loading
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(args.out))
    finally:
        app.close()
    print(f"wrote {args.out} ({message})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
