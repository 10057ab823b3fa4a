"""Loading a broken pipeline folder fails with an error that names the file and the component.

Covers truncated and corrupt weights (NaN under an intact safetensors header), classes and libraries in
``model_index.json`` (an allow-list checked before anything is imported), missing folders and files, the
VLM target's transformers loader, and the argument checks of ``RewardRouter``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.tokenizers import VQTokenizer
from mmspec.pipelines import ARImagePipeline, hub
from mmspec.pipelines.hub import ComponentLoadError
from mmspec.reward import RewardRouter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def saved_pipe(tmp_path_factory) -> Path:
    """A tiny class-conditioned ARImagePipeline (transformer + vqvae) saved once."""
    torch.manual_seed(0)
    transformer = LlamaGenTransformer(dim=32, n_layer=1, n_head=4, multiple_of=16, vocab_size=16, block_size=4,
                                      model_type="c2i", num_classes=3)
    folder = tmp_path_factory.mktemp("saved") / "pipe"
    ARImagePipeline(transformer, VQTokenizer(codebook_size=16, patch_size=2, image_size=4)).save_pretrained(folder)
    return folder


@pytest.fixture
def pipe_dir(saved_pipe, tmp_path) -> Path:
    """A fresh copy of the saved pipeline for one test to break."""
    return Path(shutil.copytree(saved_pipe, tmp_path / "pipe"))


def _edit_index(folder: Path, **entries) -> Path:
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index.update(entries)
    index_path.write_text(json.dumps(index))
    return index_path


def _escaped(path: Path) -> str:
    """``path`` as a regular expression that matches it literally."""
    return re.escape(str(path))


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _overwrite_data(file: Path, data: bytes, offset: int = 0) -> None:
    """Overwrite the tensor bytes of a safetensors file from ``offset`` on, keeping its header intact."""
    raw = bytearray(file.read_bytes())
    start = 8 + struct.unpack("<Q", raw[:8])[0] + offset  # 8-byte header length, JSON header, then data
    end = min(start + len(data), len(raw))
    raw[start:end] = data[: end - start]
    file.write_bytes(bytes(raw))


# -- weights -------------------------------------------------------------------------------------------------


def test_truncated_weights_name_the_file_and_the_component(pipe_dir):
    weights = pipe_dir / "transformer" / WEIGHTS
    _truncate(weights)
    with pytest.raises(ComponentLoadError, match="'transformer'") as caught:
        ARImagePipeline.from_pretrained(pipe_dir)
    assert str(weights) in str(caught.value)
    assert caught.value.__cause__ is not None  # the loader's own error, chained


def test_non_finite_weights_are_refused_naming_the_tensor(pipe_dir):
    weights = pipe_dir / "transformer" / WEIGHTS
    _overwrite_data(weights, b"\xff" * 4096)  # all-ones bytes: NaN in every float format
    tensors = load_file(str(weights))
    bad = {key: int((~torch.isfinite(t)).sum()) for key, t in tensors.items() if not torch.isfinite(t).all()}
    with pytest.raises(ValueError, match="non-finite") as caught:
        ARImagePipeline.from_pretrained(pipe_dir)
    message = str(caught.value)
    assert str(weights) in message and "'transformer'" in message
    named = [key for key in bad if repr(key) in message]
    assert len(named) == 1 and f"{bad[named[0]]} of" in message
    loaded = ARImagePipeline.from_pretrained(pipe_dir, check_weights=False)  # the opt-out
    assert not all(torch.isfinite(p).all() for p in loaded.transformer.parameters())


def test_an_infinite_weight_is_refused_too(pipe_dir):
    _overwrite_data(pipe_dir / "vqvae" / WEIGHTS, struct.pack("<f", math.inf))
    with pytest.raises(ValueError, match=r"'vqvae'.*1 of \d+ values of 'codebook'"):
        ARImagePipeline.from_pretrained(pipe_dir)


def test_missing_weights_file_and_folder(pipe_dir):
    (pipe_dir / "vqvae" / WEIGHTS).unlink()
    with pytest.raises(ComponentLoadError, match="'vqvae'.*" + _escaped(pipe_dir / "vqvae")):
        ARImagePipeline.from_pretrained(pipe_dir)
    shutil.rmtree(pipe_dir / "vqvae")
    with pytest.raises(FileNotFoundError, match=r"model_index.json lists the component 'vqvae'.*is missing"):
        ARImagePipeline.from_pretrained(pipe_dir)


def test_vlm_target_loaded_by_transformers_names_its_file(tmp_path):
    """The VLM pipeline's target goes through transformers' loader, which raises a SafetensorError that
    names no file; the pipeline's error names it. NaN weights are refused there too."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    from mmspec.pipelines import VLMPipeline

    clip = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, image_size=16, patch_size=4, projection_dim=16)
    text = dict(model_type="llama", vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    target = LlavaForConditionalGeneration(LlavaConfig(vision_config=clip, text_config=text, image_token_index=3,
                                                       image_seq_length=16))
    target.save_pretrained(tmp_path / "target")
    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": "VLMPipeline", "target": ["transformers", "LlavaForConditionalGeneration"],
        "processor": ["transformers", "LlavaProcessor"]}))  # the target fails before the processor is needed
    weights = tmp_path / "target" / "model.safetensors"
    intact = weights.read_bytes()
    _overwrite_data(weights, b"\xff" * 64)
    with pytest.raises(ValueError, match=_escaped(weights) + ": the component 'target' has non-finite weights"):
        VLMPipeline.from_pretrained(tmp_path)
    weights.write_bytes(intact)
    _truncate(weights)
    with pytest.raises(ComponentLoadError, match="'target'.*" + _escaped(weights) + ": SafetensorError") as caught:
        VLMPipeline.from_pretrained(tmp_path)
    assert type(caught.value.__cause__).__name__ == "SafetensorError"


# -- model_index.json ----------------------------------------------------------------------------------------


def test_unknown_class_names_the_index_the_component_and_the_class(pipe_dir):
    index_path = _edit_index(pipe_dir, vqvae=["mmspec.models.tokenizers.vq", "NoSuchTokenizer"])
    expected = _escaped(index_path) + ": the component 'vqvae' names the class 'NoSuchTokenizer'"
    with pytest.raises(ValueError, match=expected):
        ARImagePipeline.from_pretrained(pipe_dir)


def test_unimportable_library_and_malformed_entry(pipe_dir):
    index_path = _edit_index(pipe_dir, vqvae=["mmspec.models.no_such_module", "VQTokenizer"])
    with pytest.raises(ValueError, match=_escaped(index_path) + ": the component 'vqvae'.*cannot be imported"):
        ARImagePipeline.from_pretrained(pipe_dir)
    _edit_index(pipe_dir, vqvae="VQTokenizer")
    with pytest.raises(ValueError, match=r"'vqvae' must be \[library, class name\]"):
        ARImagePipeline.from_pretrained(pipe_dir)


@pytest.fixture
def side_effect_library(tmp_path, monkeypatch) -> tuple[str, Path]:
    """An importable module ``mmspec_test_untrusted_lib`` that writes a marker file when imported."""
    name, marker = "mmspec_test_untrusted_lib", tmp_path / "imported"
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    yield name, marker
    sys.modules.pop(name, None)


def test_library_outside_the_allow_list_is_refused_before_import(pipe_dir, side_effect_library, monkeypatch):
    name, marker = side_effect_library
    index_path = _edit_index(pipe_dir, vqvae=[name, "VQTokenizer"])
    expected = _escaped(index_path) + f": the component 'vqvae' names the library '{name}'"
    with pytest.raises(ValueError, match=expected):
        ARImagePipeline.from_pretrained(pipe_dir)
    assert not marker.exists() and name not in sys.modules
    # a user who trusts the library extends the allow-list; then it is imported and its classes checked
    monkeypatch.setattr(hub, "ALLOWED_LIBRARIES", hub.ALLOWED_LIBRARIES | {name})
    with pytest.raises(ValueError, match="names the class 'VQTokenizer'"):
        ARImagePipeline.from_pretrained(pipe_dir)
    assert marker.exists()


@pytest.mark.parametrize("library", ["subprocess", "os", "builtins", "mmspecial", "mmspec..models", "/tmp/x"])
def test_allow_list_matches_packages_and_their_submodules_only(pipe_dir, library):
    assert not hub.is_allowed_library(library)
    _edit_index(pipe_dir, vqvae=[library, "Popen"])
    with pytest.raises(ValueError, match="not among the allowed component libraries"):
        ARImagePipeline.from_pretrained(pipe_dir)


def test_allowed_libraries():
    for library in ("diffusers", "transformers", "mmspec", "mmspec.models.tokenizers.vq", "transformers.models"):
        assert hub.is_allowed_library(library)


def test_malformed_model_index_names_the_file(pipe_dir):
    (pipe_dir / "model_index.json").write_text("{not json")
    with pytest.raises(ValueError, match=_escaped(pipe_dir / "model_index.json") + " is not valid JSON"):
        ARImagePipeline.from_pretrained(pipe_dir)


# -- RewardRouter's arguments --------------------------------------------------------------------------------


def _scores(frames, prompt):
    return [1.0]


@pytest.mark.parametrize("tau", ["x", "0.5", None, True, float("nan"), torch.tensor(0.5), [0.5]])
def test_reward_router_refuses_a_bad_tau_naming_it(tau):
    with pytest.raises(ValueError, match="tau must be a real number"):
        RewardRouter(_scores, tau=tau)


def test_reward_router_accepts_real_numbers_and_checks_its_other_arguments():
    import numpy as np

    assert RewardRouter(_scores, tau=np.float32(0.5)).tau == 0.5
    assert RewardRouter(_scores, tau=1).tau == 1.0 and RewardRouter(_scores, tau=-math.inf).tau == -math.inf
    with pytest.raises(ValueError, match="aggregate must be one of 'min', 'mean', got 'max'"):
        RewardRouter(_scores, tau=0.0, aggregate="max")
    with pytest.raises(ValueError, match="aggregate must be one of"):
        RewardRouter(_scores, tau=0.0, aggregate=["min"])
    with pytest.raises(ValueError, match="force_reject_first must be True or False"):
        RewardRouter(_scores, tau=0.0, force_reject_first="yes")
    with pytest.raises(ValueError, match="reward_fn must be callable"):
        RewardRouter("imagereward", tau=0.0)
