"""``--device`` / ``--dtype`` on the commands, device checks, and every zoo pipeline on the machine's device."""

from __future__ import annotations

import argparse

import pytest
import torch

from mmspec.cli import build_parser
from mmspec.cli import main as cli_main
from mmspec.devices import check_device, default_device, device_argument, load_pipeline, resolved_device

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ZOO = {"vlm": ("VLMPipeline", "mmspec/shapes-vlm"), "ar_image": ("ARImagePipeline", "mmspec/shapes-t2i"),
       "continuous": ("ContinuousARImagePipeline", "mmspec/shapes-t2i-continuous"),
       "video": ("ARVideoPipeline", "mmspec/shapes-video")}


def test_default_device_follows_what_torch_sees():
    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolved_device(argparse.Namespace(device=None)) == torch.device(default_device())
    assert resolved_device(argparse.Namespace(device=torch.device("cpu"))) == torch.device("cpu")


@pytest.mark.parametrize("text, match", [("tpu", "torch device"), ("xla", "must be .cpu., .cuda."), ("cuda:x", "torch device"),
                                         ("", "torch device")])
def test_bad_devices_are_refused_naming_the_argument(text, match):
    with pytest.raises(ValueError, match=match) as error:
        check_device(text, "--device")
    assert "--device" in str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_cuda_without_a_gpu_is_a_clear_command_line_error(capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="no CUDA GPU"):
        device_argument("cuda")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", "a red circle", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "a red circle"], ["demo"]])
def test_commands_take_device_and_dtype(command):
    args = build_parser(command[0]).parse_args([*command, "--device", "cpu", "--dtype", "bfloat16"])
    assert args.device == torch.device("cpu") and args.dtype is torch.bfloat16
    defaults = build_parser(command[0]).parse_args(command)
    assert defaults.device is None and defaults.dtype is torch.float32  # None: the machine's default device
    assert defaults.cpu_gemm == "plain"  # packed CPU GEMMs are opt-in, as on a pipeline


@pytest.mark.parametrize("module", ["bench_ar_image", "bench_vlm", "bench_continuous", "bench_video"])
def test_benchmarks_take_device_and_dtype(module, capsys):
    import importlib

    bench = importlib.import_module(f"mmspec.evaluation.{module}")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--device" in text and "--dtype" in text


@pytest.mark.parametrize("family", list(ZOO))
def test_every_zoo_pipeline_loads_on_the_default_device_in_the_asked_precision(family):
    import mmspec.pipelines

    name, zoo_id = ZOO[family]
    pipe = load_pipeline(getattr(mmspec.pipelines, name), zoo_id, dtype=torch.float32)
    modules = [module for module in pipe.components.values() if isinstance(module, torch.nn.Module)]
    assert modules
    for module in modules:
        for parameter in module.parameters():
            assert parameter.device.type == default_device(), (family, type(module).__name__)


def _one_call(family: str, device: str) -> torch.Tensor:
    """One zoo call of ``family`` on ``device`` (greedy where the pipeline has it, a fixed seed otherwise): the
    generated ids or latents, on the CPU."""
    import mmspec.pipelines

    name, zoo_id = ZOO[family]
    pipe = load_pipeline(getattr(mmspec.pipelines, name), zoo_id, device=device)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator(device).manual_seed(0)
    if family == "vlm":
        from mmspec.world import render_scene, sample_scene

        image = render_scene(sample_scene(0), image_size=64)
        return pipe(image, "describe the image in detail.", method="flash", max_new_tokens=64).tokens[0].cpu()
    if family == "ar_image":
        return pipe("a red circle", method="eagle", do_sample=False, output_type="tokens").tokens.cpu()
    if family == "continuous":
        return pipe("two blue squares", method="cspd", num_iter=16, output_type="latent",
                    generator=generator).tokens.cpu()
    return pipe("a red circle moving right", method="sdvg", output_type="latent", generator=generator).latents.cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", list(ZOO))
def test_every_zoo_pipeline_decodes_on_cuda_on_the_cpu_code_path(family):
    """The same call on CUDA and on the CPU: greedy token pipelines give the same tokens (float32, TF32 off for
    matmuls by torch's default); sampled ones the same shapes with finite values (their random streams are
    the device's own)."""
    on_gpu, on_cpu = _one_call(family, "cuda"), _one_call(family, "cpu")
    assert on_gpu.shape == on_cpu.shape
    if family in ("vlm", "ar_image"):
        assert torch.equal(on_gpu, on_cpu)
    else:
        assert torch.isfinite(on_gpu).all()
