"""One pipeline, two threads: concurrent calls (``stream()`` beside ``__call__``, AR image calls of two methods)
give exactly what the same calls give one after another, and the hooks a call puts on a shared model read
only its own thread's forwards (mmspec.hidden_capture.thread_scoped)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import tiny_llama
from pipeline_utils import quiet_pipeline

from mmspec.hidden_capture import HiddenStateCapture, find_decoder
from mmspec.methods.eagle import EagleConfig, LanternConfig
from mmspec.models import shapes_vlm as sv
from mmspec.pipelines import ARImagePipeline, VLMPipeline
from mmspec.pipelines.vlm import VLMPipelineOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPEATS = 3


def run_together(*jobs: Callable[[], Any]) -> list[Any]:
    """Run each job ``REPEATS`` times in its own thread, all threads at once; returns per job the list of
    its results, re-raising the first error of any thread."""
    results: list[list[Any]] = [[] for _ in jobs]
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def loop(index: int) -> None:
        try:
            start.wait()
            for _ in range(REPEATS):
                results[index].append(jobs[index]())
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=loop, args=(index,)) for index in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish"
    return results


# -- VLMPipeline ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vlm() -> VLMPipeline:
    return quiet_pipeline(VLMPipeline, "mmspec/shapes-vlm")


def _streamed(pipe: VLMPipeline, *args: Any, **kwargs: Any) -> VLMPipelineOutput:
    *_, final = pipe.stream(*args, **kwargs)
    return final


@pytest.mark.parametrize("method", ["eagle", "none"])
def test_vlm_stream_and_call_in_two_threads_match_single_threaded_runs(vlm, method):
    """The prefill's embedding hook and the hidden-state hooks sit on the shared language model; a thread's
    forwards must not land in the other thread's capture (formerly "index 7 is out of bounds")."""
    image = sv.image_example("test", 0, 0, "describe")
    video = sv.video_example("test", 0, 1, "narrate")
    kwargs = dict(do_sample=False, max_new_tokens=16)

    def stream_image() -> VLMPipelineOutput:
        return _streamed(vlm, list(image["frames"]), image["prompt"], method, **kwargs)

    def call_video() -> VLMPipelineOutput:
        return vlm(videos=[list(video["frames"])], prompt=video["prompt"], method=method, **kwargs)

    expected = [stream_image(), call_video()]
    for job_results, reference in zip(run_together(stream_image, call_video), expected):
        for out in job_results:
            assert out.text == reference.text
            assert all(torch.equal(a, b) for a, b in zip(out.tokens, reference.tokens))


def test_vlm_sampled_runs_in_two_threads_follow_their_own_generators(vlm):
    image = sv.image_example("test", 0, 2, "describe")

    def sampled(seed: int) -> Callable[[], VLMPipelineOutput]:
        return lambda: vlm(list(image["frames"]), image["prompt"], "none", do_sample=True, max_new_tokens=12,
                           generator=torch.Generator().manual_seed(seed))

    jobs = [sampled(0), sampled(1)]
    expected = [job() for job in jobs]
    for job_results, reference in zip(run_together(*jobs), expected):
        assert all(torch.equal(out.tokens[0], reference.tokens[0]) for out in job_results)


# -- ARImagePipeline ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def t2i() -> ARImagePipeline:
    return quiet_pipeline(ARImagePipeline, "mmspec/shapes-t2i")


def test_ar_image_calls_in_two_threads_match_single_threaded_runs(t2i):
    """EAGLE (target features, a head with its own cache) beside LANTERN (the pipeline's lazily built
    codebook-neighbour table), each with its own seeded generator."""
    def call(method: str, prompt: str, seed: int) -> Callable[[], torch.Tensor]:
        config = {"eagle": EagleConfig, "lantern": LanternConfig}[method](num_draft_tokens=4)
        return lambda: t2i(prompt, method=config, output_type="tokens",
                           generator=torch.Generator().manual_seed(seed)).tokens

    jobs = [call("eagle", "a red circle", 0), call("lantern", "a blue square", 1)]
    expected_eagle = jobs[0]()
    results = run_together(*jobs)  # the threads' first LANTERN call builds the neighbour table
    expected_lantern = jobs[1]()
    for job_results, reference in zip(results, (expected_eagle, expected_lantern)):
        assert all(torch.equal(tokens, reference) for tokens in job_results)


# -- the hooks themselves ---------------------------------------------------------------------------------------
def test_hidden_state_capture_ignores_forwards_of_other_threads():
    """While one thread records, a forward run by another thread leaves the recording untouched."""
    model = tiny_llama()
    capture = HiddenStateCapture(find_decoder(model))
    ids = torch.tensor([[1, 5, 7, 9]])
    other = threading.Thread(target=lambda: model(input_ids=ids[:, :2]))
    with torch.no_grad(), capture.recording(top=True, penultimate=True) as grabbed:
        other.start()
        other.join()
        assert grabbed == {}
        model(input_ids=ids)
    assert grabbed["top"].shape[1] == 4 and grabbed["penultimate"].shape[1] == 4


def test_switching_value_checks_off_affects_only_the_calling_thread():
    """A decoding loop switches the probability checks off around verification; another thread's checks stay
    on meanwhile, and interleaved switches never leave them off (they once did: a shared global flag)."""
    import threading

    from mmspec.validation import checks_enabled, value_checks

    inside, release, seen = threading.Event(), threading.Event(), []

    def loop() -> None:
        with value_checks(False):
            seen.append(checks_enabled())
            inside.set()
            release.wait(10)

    worker = threading.Thread(target=loop)
    worker.start()
    inside.wait(10)
    seen.append(checks_enabled())  # this thread, while the other has them off
    with value_checks(False):
        release.set()
        worker.join(10)
    assert seen == [False, True] and checks_enabled()
