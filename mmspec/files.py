"""Atomic writes for every file the package writes for its users (images, videos, reports, checkpoints).

A writer fills a temporary file in the destination folder and renames it onto the final name only once the
write has finished, so a run that fails, is interrupted or is killed (SIGTERM, a lease's end) leaves the
previous file or none under the final name, never a truncated one. The rename is atomic because the
temporary file is on the same file system.

Temporary files are named ``.<name>.tmp-<pid>-<random>`` (hidden, and without the final suffix unless a
writer needs it, see ``keep_suffix``), so one left behind by a killed process is never taken for an output
by the tools that list a folder's images or reports (:func:`is_temporary`). None is left behind by SIGTERM or
SIGHUP either: while a write is under way in the main thread, those signals (when they still have their
default, process-ending action) first remove the temporary file, then end the process as the signal would
have (:func:`_removed_on_termination`). SIGKILL cannot be caught; its leftovers stay hidden.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

TEMPORARY_MARKER = ".tmp-"  # in every temporary name: ``.<name>.tmp-<pid>-<random>``


def _default_permissions() -> int:
    """The mode a plain ``open(path, "w")`` would give a new file (0666 less the umask); ``mkstemp``
    creates 0600, which would make outputs unreadable to other users."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _temporary_file(path: Path, keep_suffix: bool) -> Path:
    """Create (empty) and return a fresh temporary file beside ``path``."""
    suffix = f"{TEMPORARY_MARKER}{os.getpid()}-"
    handle, name = tempfile.mkstemp(prefix=f".{path.name}{suffix}", suffix=path.suffix if keep_suffix else "",
                                    dir=path.parent)
    os.close(handle)
    return Path(name)


def _flush_to_disk(path: Path) -> None:
    """fsync the finished temporary file, so that after a crash the renamed file has its content too."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


#: signals whose default action ends the process and that a write cleans up after (SIGHUP: POSIX only)
_TERMINATING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class _Terminated(BaseException):
    """Raised inside a write by a terminating signal, so the write's cleanup runs before the process ends."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(signum)


@contextlib.contextmanager
def _removed_on_termination() -> Iterator[None]:
    """During the block, SIGTERM / SIGHUP raise inside it (only where they would have ended the process: the
    default handler, in the main thread) and, once the block's cleanup has run, end the process with that
    signal's own status. Handlers a program installed itself are left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    replaced = {}
    for signum in _TERMINATING_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            replaced[signum] = signal.signal(signum, _raise_terminated)
    try:
        yield
    except _Terminated as terminated:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)
        replaced = {}
        os.kill(os.getpid(), terminated.signum)  # the default action: the process ends here
        raise  # pragma: no cover - only where the signal did not end the process
    finally:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, keep_suffix: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to; it is renamed onto ``path`` when the block ends
    without an exception. On an exception the temporary file is removed and ``path`` is left untouched.

    Use it for writers that take a path (``torch.save``, ``safetensors``' ``save_file``, ``fig.savefig``).
    ``keep_suffix=True`` ends the temporary name with ``path``'s suffix, for writers that pick the format
    from the file name (video encoders). The parent folder is created if needed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary: Path | None = None
    with _removed_on_termination():
        try:
            temporary = _temporary_file(path, keep_suffix)
            yield temporary
            os.chmod(temporary, _default_permissions())
            _flush_to_disk(temporary)
            os.replace(temporary, path)
        finally:
            if temporary is not None:
                temporary.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside ``path`` (``mode`` "w" for text or "wb" for bytes) and yield its
    handle; it replaces ``path`` once the block ends without an exception (see :func:`atomic_path`)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    with atomic_path(path) as temporary:
        with open(temporary, mode, encoding=None if mode == "wb" else encoding) as handle:
            yield handle


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_write(path) as handle:
        handle.write(text)
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj: Any, *, indent: int = 2, default: Any = None) -> Path:
    """Write ``obj`` as JSON (``indent``; ``default`` as in :func:`json.dumps`) to ``path`` atomically."""
    return write_text_atomic(path, json.dumps(obj, indent=indent, default=default) + "\n")


def write_jsonl_atomic(path: str | os.PathLike, rows: Sequence[dict]) -> Path:
    """Write one JSON object per line to ``path`` atomically."""
    return write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def save_image_atomic(image: Any, path: str | os.PathLike, **save_kwargs: Any) -> Path:
    """Save a PIL image to ``path`` atomically, in the format ``path``'s suffix names (PNG if unknown).

    ``save_kwargs`` go to ``Image.save``: an animated GIF is ``save_image_atomic(frames[0], "a.gif",
    save_all=True, append_images=frames[1:], duration=250, loop=0)``.
    """
    from PIL import Image

    path = Path(path)
    image_format = Image.registered_extensions().get(path.suffix.lower(), "PNG")
    with atomic_path(path) as temporary:
        image.save(temporary, format=image_format, **save_kwargs)
    return path


def is_temporary(path: str | os.PathLike) -> bool:
    """Whether ``path`` is named like a temporary file of :func:`atomic_path` (``.<name>.tmp-<pid>-...``)."""
    name = Path(path).name
    return name.startswith(".") and TEMPORARY_MARKER in name
