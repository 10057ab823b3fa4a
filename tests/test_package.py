"""Packaging promises: one namespace, light imports, the CLI."""

import subprocess
import sys


def test_import_mmspec_pulls_no_optional_dependency():
    code = (
        "import sys, mmspec\n"
        "from mmspec import verify_tokens, speculative_generate, ModelDrafter\n"
        "heavy = [m for m in ('triton', 'open_clip', 'ImageReward', 'gradio', 'diffusers', 'torchvision')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "import mmspec.pipelines, mmspec.models, mmspec.evaluation\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_cli_info_runs():
    out = subprocess.run([sys.executable, "-m", "mmspec.cli", "info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("mmspec ") and "kernel backend here: torch" in out.stdout


def test_zoo_configs_carry_no_build_local_paths():
    """diffusers records in ``_name_or_path`` where a component was loaded from; in a shipped zoo entry
    that is the build machine's training folder, which means nothing in a clone (the builds drop it)."""
    import json
    from pathlib import Path

    import mmspec.models

    configs = sorted(Path(mmspec.models.__path__[0], "zoo").glob("*/*/config.json"))
    assert len(configs) >= 10  # the four zoo entries' components
    for config in configs:
        assert "_name_or_path" not in json.loads(config.read_text()), config


def test_package_data_ships_every_zoo_file():
    """A non-editable install carries only what setup.py's ``package_data`` names: every file a zoo folder
    holds must match one of its patterns (a missing chat template made the installed VLM zoo answer wrongly)."""
    import ast
    import fnmatch
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    tree = ast.parse((root / "setup.py").read_text())
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    package_data = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "package_data"))
    patterns = package_data["mmspec.models"]
    zoo_files = [path.relative_to(root / "models") for path in (root / "models" / "zoo").rglob("*")
                 if path.is_file() and path.suffix != ".py" and "__pycache__" not in path.parts]
    assert len(zoo_files) >= 60
    unshipped = [str(f) for f in zoo_files
                 if not any(fnmatch.fnmatch(str(f), pattern.replace("**/", "*/")) for pattern in patterns)]
    assert not unshipped, f"zoo files no package_data pattern ships: {unshipped}"
