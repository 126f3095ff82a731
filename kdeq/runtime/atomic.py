"""Files written so that a crash or an interruption never leaves a set of them half written.

``write_files`` writes a set of files that belong together (a checkpoint's ``config.json`` and
``weights.safetensors``, a trainer's resume state) into one folder. Each file is written in full to a
temporary name in the same file system and then renamed into place: a rename within one file system
is atomic, so a file is either wholly the old one or wholly the new one. A set of files needs more:

- into a folder that does not exist yet (or is empty), the files are written into a temporary
  sibling folder that is renamed to the folder's name once they are all written: the folder then
  holds either nothing or the whole set;
- into a folder that holds other files (a trainer's ``report/`` beside its checkpoint), the set's
  last file, the one whose presence marks the set complete (a checkpoint's ``config.json``), is
  removed before the others are renamed into place and renamed last. Ctrl-C (``SIGINT``) and
  ``SIGTERM`` are held back while the renames run, so an interruption leaves the old set or the new
  one; only a harder end (``SIGKILL``, power loss) between two renames can leave the set without its
  last file, which readers take for no set at all, never a mix of old and new.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

#: the signals an interactive stop or a job scheduler sends, held back while a set is renamed in
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold ``HELD_SIGNALS`` back while the body runs and deliver them after it, to the handlers they
    had before. Only the main thread runs Python's signal handlers; elsewhere this holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.getsignal(s) for s in HELD_SIGNALS}
    # a handler installed outside Python (getsignal's None) cannot be put back, so it is left alone
    held = [s for s, handler in previous.items() if handler is not None]
    for s in held:
        signal.signal(s, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        for s in held:
            signal.signal(s, previous[s])
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


def _write_synced(path: Path, data: bytes) -> None:
    """``data`` to a new file ``path`` (an existing one is an error), flushed to the disk."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_folder(path: Path) -> None:
    """Flush ``path``'s entries (the renames into it) to the disk, where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform whose folders cannot be opened (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temporary_name(path: Path) -> Path:
    """A hidden name beside ``path`` that nothing else uses (the random part keeps two writers apart)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def write_files(directory: str | Path, files: Mapping[str, bytes]) -> None:
    """Write ``files`` (name → bytes) into ``directory``, creating it and its parents: afterwards the
    folder holds all of them; after a crash or an interruption it holds the set it held before (or
    nothing of it), never some new files beside old ones. The last of ``files`` marks the set complete
    (see the module's docstring). Other files in ``directory`` are left as they are."""
    directory = Path(directory)
    if not files:
        raise ValueError("write_files needs at least one file")
    # a link to a folder is written through, not replaced by a folder of its own
    if directory.is_symlink() or (directory.is_dir() and any(directory.iterdir())):
        _replace_within(directory, files)
    else:
        _write_new_folder(directory, files)


def _write_new_folder(directory: Path, files: Mapping[str, bytes]) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(directory)
    tmp.mkdir()
    try:
        for name, data in files.items():
            _write_synced(tmp / name, data)
        # a rename may replace an empty folder (POSIX), not one that something filled meanwhile
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _sync_folder(directory.parent)


def _replace_within(directory: Path, files: Mapping[str, bytes]) -> None:
    *others, last = files
    temps = {name: _temporary_name(directory / name) for name in files}
    try:
        for name, data in files.items():
            _write_synced(temps[name], data)
        with signals_held():
            if others:
                # without its last file the set reads as absent while the others are replaced
                (directory / last).unlink(missing_ok=True)
            for name in [*others, last]:
                os.replace(temps[name], directory / name)
    except BaseException:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        raise
    _sync_folder(directory)
