"""Atomic writes (``mmspec.files``): a writer that fails or is killed mid-write leaves the previous file or
nothing under the final name, never a truncated one, and its temporary file is never taken for output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

import mmspec.files
from mmspec.evaluation.files import list_images
from mmspec.files import (
    atomic_path,
    atomic_write,
    is_temporary,
    save_image_atomic,
    write_json_atomic,
    write_text_atomic,
)
from mmspec.pipelines.ar_video import export_video


def _noise_image(side: int = 64, seed: int = 0) -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if is_temporary(p))


def test_writes_land_whole_with_normal_permissions(tmp_path):
    path = write_text_atomic(tmp_path / "sub" / "report.md", "table\n")
    assert path.read_text() == "table\n"
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    assert write_json_atomic(tmp_path / "r.json", {"a": 1}).read_text() == '{\n  "a": 1\n}\n'
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["report.md"]


@pytest.mark.parametrize("existing", [True, False])
def test_a_failing_writer_leaves_the_old_file_or_nothing(tmp_path, existing):
    path = tmp_path / "out.txt"
    if existing:
        path.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_write(path) as handle:
            handle.write("new, half")
            raise RuntimeError("disk full")
    assert (path.read_text() == "old") if existing else not path.exists()
    assert _leftovers(tmp_path) == []


def test_a_failing_image_save_leaves_the_old_image(tmp_path, monkeypatch):
    path = tmp_path / "image.png"
    save_image_atomic(_noise_image(seed=1), path)
    real_save = PIL.Image.Image.save

    def save_half_then_die(image, target, *args, **kwargs):  # writes a truncated PNG, then fails
        real_save(image, target, *args, **kwargs)
        with open(target, "r+b") as handle:
            handle.truncate(100)
        raise KeyboardInterrupt

    monkeypatch.setattr(PIL.Image.Image, "save", save_half_then_die)
    with pytest.raises(KeyboardInterrupt):
        save_image_atomic(_noise_image(seed=2), path)
    monkeypatch.undo()
    with PIL.Image.open(path) as reloaded:
        assert np.array_equal(np.asarray(reloaded), np.asarray(_noise_image(seed=1)))
    assert _leftovers(tmp_path) == []


def test_gif_from_export_video_is_written_atomically(tmp_path):
    frames = [_noise_image(8, seed) for seed in range(3)]
    path = export_video(frames, tmp_path / "clip.gif", fps=4)
    with PIL.Image.open(path) as gif:
        assert gif.format == "GIF" and gif.n_frames == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.gif"]


def test_temporary_names_are_hidden_and_not_listed_as_images(tmp_path):
    with atomic_path(tmp_path / "b.png") as temporary:
        assert is_temporary(temporary) and temporary.parent == tmp_path
        assert temporary.name.startswith(".b.png.tmp-") and temporary.suffix != ".png"
    with atomic_path(tmp_path / "c.mp4", keep_suffix=True) as temporary:
        assert is_temporary(temporary) and temporary.suffix == ".mp4"
    images = tmp_path / "images"
    save_image_atomic(_noise_image(8), images / "a.png")
    (images / f".d.png.tmp-{os.getpid()}-x.png").write_bytes(b"half")  # a killed writer's leftover
    assert [p.name for p in list_images(images)] == ["a.png"]


# -- killed writers -------------------------------------------------------------------------------------------

# The child loads mmspec/files.py by its path: importing the mmspec package imports torch (seconds).
_CHILD_PRELUDE = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("atomic_files", {str(Path(mmspec.files.__file__))!r})
files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(files)
"""


def _start_child(body: str, *args: str) -> subprocess.Popen:
    code = _CHILD_PRELUDE + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)


def _terminate_after(child: subprocess.Popen, line: str) -> None:
    """Wait until the child prints ``line``, then SIGTERM it and wait for it to die."""
    try:
        assert child.stdout.readline().strip() == line
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == -signal.SIGTERM
    finally:
        child.kill()
        child.stdout.close()


@pytest.mark.parametrize("existing", [True, False])
def test_sigterm_mid_write_leaves_the_old_file_or_nothing(tmp_path, existing):
    path = tmp_path / "out.bin"
    if existing:
        path.write_bytes(b"old")
    child = _start_child("""
        with files.atomic_write(sys.argv[1], "wb") as handle:
            handle.write(b"new" * 100000)
            handle.flush()
            print("writing", flush=True)
            time.sleep(60)
            handle.write(b"end")
    """, str(path))
    _terminate_after(child, "writing")
    assert (path.read_bytes() == b"old") if existing else not path.exists()
    assert not _leftovers(tmp_path)  # the signal removed the temporary file before ending the process


def test_sigterm_during_a_loop_of_png_writes_leaves_a_whole_png(tmp_path):
    """Like ``mmspec generate`` killed while writing its PNGs: the file under the final name decodes."""
    path = tmp_path / "image.png"
    child = _start_child("""
        import numpy as np
        from PIL import Image
        image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8))
        files.save_image_atomic(image, sys.argv[1])
        print("saved once", flush=True)
        while True:
            files.save_image_atomic(image, sys.argv[1])
    """, str(path))
    _terminate_after(child, "saved once")
    with PIL.Image.open(path) as image:
        image.load()  # a truncated PNG raises here
        assert image.size == (256, 256)
    assert not _leftovers(tmp_path)


def test_a_program_that_handles_sigterm_itself_keeps_its_handler(tmp_path):
    """The cleanup only replaces the default action: a program's own SIGTERM handler runs as before (here it
    only records the signal, and the write completes)."""
    path = tmp_path / "out.bin"
    child = _start_child("""
        import signal
        seen = []
        signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
        with files.atomic_write(sys.argv[1], "wb") as handle:
            print("writing", flush=True)
            while not seen:
                time.sleep(0.01)
            handle.write(b"whole")
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        print("done", flush=True)
    """, str(path))
    try:
        assert child.stdout.readline().strip() == "writing"
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline().strip() == "done" and child.wait(timeout=30) == 0
    finally:
        child.kill()
        child.stdout.close()
    assert path.read_bytes() == b"whole" and not _leftovers(tmp_path)
