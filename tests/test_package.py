"""Packaging promises: one namespace, light imports, the CLI."""

import subprocess
import sys

import pytest


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


def test_python_dash_m_mmspec_is_the_cli():
    """``python -m mmspec`` runs the same command line as the ``mmspec`` console script."""
    import mmspec

    out = subprocess.run([sys.executable, "-m", "mmspec", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"mmspec {mmspec.__version__}"
    out = subprocess.run([sys.executable, "-m", "mmspec", "generate", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: mmspec generate") and "--outdir" in out.stdout


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


def test_version_flag_prints_the_package_version():
    """``mmspec --version`` answers without importing torch or the pipelines (it runs in well under a second)."""
    import mmspec

    script = ("import sys; from mmspec.cli import main\n"
              "try:\n    main(['--version'])\nexcept SystemExit as exit:\n    assert exit.code == 0\n"
              "heavy = sorted(m for m in ('torch', 'diffusers', 'transformers', 'mmspec.pipelines') if m in sys.modules)\n"
              "print('imported:', heavy)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"mmspec {mmspec.__version__}", "imported: []"]


def test_core_names_load_on_first_use():
    """`import mmspec` is free; every name in ``mmspec.__all__`` still resolves (from its own module)."""
    script = ("import sys, mmspec\nassert 'torch' not in sys.modules, 'import mmspec imported torch'\n"
              "missing = [n for n in mmspec.__all__ if getattr(mmspec, n, None) is None]\nprint(missing)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_release_files_exist_and_are_packaged():
    """LICENSE (named by pyproject), CHANGELOG with the current version, and the PEP 561 marker in package_data."""
    import tomllib
    from pathlib import Path

    import mmspec

    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (root / "LICENSE").read_text()
    assert f"## {mmspec.__version__}" in (root / "CHANGELOG.md").read_text()
    assert (root / "mmspec" / "py.typed").is_file()
    assert '"mmspec": ["py.typed"]' in (root / "setup.py").read_text()


def _requirements(lines: list[str]) -> dict[str, object]:
    from packaging.requirements import Requirement

    parsed = [Requirement(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return {req.name.lower().replace("_", "-"): req for req in parsed}


def test_dependency_floors_are_what_ci_installs():
    """Each core dependency's floor in pyproject.toml is in the minor version that requirements/constraints.txt
    pins (what the set-up and CI install), the pin satisfies the declared range, and the environment has it."""
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    declared = _requirements(tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"])
    pinned = _requirements((root / "requirements" / "constraints.txt").read_text().splitlines())
    for name, requirement in declared.items():
        assert name in pinned, f"{name} is a dependency but constraints.txt does not pin it"
        pins = [spec.version for spec in pinned[name].specifier if spec.operator == "=="]
        assert len(pins) == 1, f"constraints.txt must pin {name} to one release, got {pinned[name]}"
        floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        assert len(floors) == 1, f"pyproject.toml must give {name} a floor, got {requirement}"
        assert pins[0].split(".")[:2] == floors[0].split(".")[:2], f"{name}: floor {floors[0]} but CI installs {pins[0]}"
        assert requirement.specifier.contains(pins[0]), f"{name}: the pinned {pins[0]} is outside {requirement}"
        assert version(name).split("+")[0] == pins[0], f"{name}: installed {version(name)}, pinned {pins[0]}"


@pytest.mark.slow
def test_wheel_installs_and_decodes_like_the_checkout():
    """The built wheel, installed on its own, runs one call per pipeline on the zoo exactly as the checkout does
    (the chat template once went missing from the wheel and the installed VLM answered wrongly)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(["bash", str(root / "scripts" / "wheel_smoke.sh")], capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "wheel smoke test passed: vlm, ar_image, continuous, video" in out.stdout


def test_sdist_and_wheel_carry_the_changelog_and_complete_metadata(tmp_path):
    """Built as a release is (the sdist from the tracked files, the wheel from the unpacked sdist): CHANGELOG.md
    is in both, and the wheel's METADATA names the authors, the classifiers and the license."""
    import shutil
    import tarfile
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    source = tmp_path / "source"
    for name in filter(None, listed.stdout.split("\0")):
        if (root / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, source / name)
    build = "from setuptools import build_meta as b; import sys; print(getattr(b, sys.argv[1])(sys.argv[2]))"
    sdist = subprocess.run([sys.executable, "-c", build, "build_sdist", str(tmp_path)], cwd=source,
                           capture_output=True, text=True, timeout=300)
    assert sdist.returncode == 0, sdist.stderr[-2000:]
    archive = tmp_path / sdist.stdout.strip().splitlines()[-1]
    with tarfile.open(archive) as tar:
        assert any(name.endswith("/CHANGELOG.md") for name in tar.getnames())
        tar.extractall(tmp_path / "unpacked", filter="data")
    unpacked = next((tmp_path / "unpacked").iterdir())
    wheel = subprocess.run([sys.executable, "-c", build, "build_wheel", str(tmp_path)], cwd=unpacked,
                           capture_output=True, text=True, timeout=300)
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    with zipfile.ZipFile(tmp_path / wheel.stdout.strip().splitlines()[-1]) as whl:
        names = whl.namelist()
        metadata = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert any(name.endswith("data/share/doc/mmspec/CHANGELOG.md") for name in names)
    assert "Author: The mmspec authors" in metadata and "License-Expression: Apache-2.0" in metadata
    assert "Classifier: Programming Language :: Python :: 3.11" in metadata and "Classifier: Typing :: Typed" in metadata
