"""Every Python block and shell command of the README runs as written (so the user's page cannot rot).

Each ```python block runs in a fresh interpreter in a scratch folder (blocks are independent, as a reader
copies them one at a time); each ```bash block runs line by line in one shell, from a copy of nothing but
a scratch folder, with the set-up's ``bin`` folder first on ``PATH`` (what ``source .venv/bin/activate``
does). Lines that are not quick checks are left out, each for a stated reason:

* the set-up and test commands (``bash scripts/setup.sh``, ``bash scripts/test.sh``): this suite is what the
  test command runs, and CI runs both from a fresh clone;
* servers (``mmspec demo``): they run until stopped; the demo has its own tests.

Everything else (the main job, ``--help`` of the recipes, the quickstart per pipeline) runs offline on the
bundled zoo in about two minutes; the block tests are marked slow and run in CI's second step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)

#: README shell lines not run here, with the reason (see the module docstring)
SKIPPED_COMMANDS = {
    "bash scripts/setup.sh": "the set-up: CI runs it from a fresh clone",
    "bash scripts/test.sh": "the test command: this suite is what it runs",
    "mmspec demo": "a server: runs until stopped (tests/test_demo.py covers it)",
}


def readme_blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall((ROOT / "README.md").read_text()) if lang == language]


def shell_lines(block: str) -> list[str]:
    """The block's commands (comments and blank lines dropped, ``\\`` continuations joined)."""
    text = re.sub(r"\\\n\s*", " ", block)
    lines = [line.split("  #", 1)[0].strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def is_skipped(line: str) -> bool:
    return any(line == command or line.startswith(command + " ") for command in SKIPPED_COMMANDS)


def environment() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_the_readme_has_the_blocks_this_test_runs():
    python, bash = readme_blocks("python"), readme_blocks("bash")
    assert len(python) >= 4, "one quickstart block per pipeline"
    commands = [line for block in bash for line in shell_lines(block)]
    assert "bash scripts/setup.sh" in commands and "bash scripts/test.sh" in commands
    assert any(line.startswith("mmspec generate") for line in commands)
    assert sum(not is_skipped(line) for line in commands) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(readme_blocks("python"))))
def test_readme_python_block_runs(index, tmp_path):
    code = readme_blocks("python")[index]
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environment(), capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, f"README python block {index} failed:\n{code}\n{result.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(readme_blocks("bash"))))
def test_readme_shell_block_runs(index, tmp_path):
    lines = [line for line in shell_lines(readme_blocks("bash")[index]) if not is_skipped(line)]
    # `source .venv/bin/activate` names the set-up's environment: here it is the one running the tests
    lines = [f"source {Path(sys.executable).parent}/activate" if line == "source .venv/bin/activate" else line
             for line in lines]
    if not lines:
        pytest.skip("every command of this block is a set-up, test or server command (see SKIPPED_COMMANDS)")
    script = "set -euo pipefail\n" + "\n".join(lines)
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=environment(), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, f"README shell commands failed:\n{script}\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
