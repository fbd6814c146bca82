"""Atomic file output (a killed stage never leaves a half-written artifact behind, and the next
writer of the same path clears what a killed one left) and inter-process file locks."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write to; on success it replaces `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clear_stale_writes(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
        if path.is_dir() and tmp.is_dir():
            # Directories cannot be swapped by one rename: move the old one aside first.
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            _remove(old)
        else:
            os.replace(tmp, path)
    finally:
        _remove(tmp)


def clear_stale_writes(path: Path) -> None:
    """Clear the siblings that writers of `path` killed mid-write left (their pid is gone).

    A `.tmp-PID` is an unfinished output: removed. An `.old-PID` is the previous result, moved
    aside for a directory swap: put back when `path` is missing (the kill fell between the two
    renames), removed when the new result is in place.
    """
    path = Path(path)
    stale = []
    for sibling in path.parent.glob(f".{glob.escape(path.name)}.*-*"):
        kind, _, pid = sibling.name[len(path.name) + 2 :].partition("-")
        if kind in ("old", "tmp") and pid.isdigit() and not pid_alive(int(pid)):
            stale.append((kind, sibling))
    for kind, sibling in sorted(stale):  # "old" first: restore before discarding a partial
        if kind == "old" and not (path.exists() or path.is_symlink()):
            os.replace(sibling, path)
        else:
            _remove(sibling)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextmanager
def file_lock(path: Path, *, wait: bool = True) -> Iterator[IO[str]]:
    """Hold an exclusive `flock` on `path` (created if missing) and yield its open handle.

    The kernel drops the lock when the holder exits or is killed, so no lock is ever stale.
    With wait=False a lock held elsewhere raises BlockingIOError at once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield handle
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_json(path: Path, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=_jsonable) + "\n")


def write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
