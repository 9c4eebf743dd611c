"""What a save removes once its manifest has landed: the rank files of earlier saves under its tag, and temporary
files whose writers are gone (a save killed part way), under every tag."""
from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Iterable

from tiering.stale import pid_alive, this_host

from .format import RANK_FILE, TEMP_FILE


def remove_replaced(tag_dir: str, kept: Iterable[str]) -> None:
    """After a manifest landed: remove the rank files of earlier saves under this tag that it does not name. Best
    effort: what cannot be removed stays, named by no manifest."""
    kept = set(kept)
    for name in os.listdir(tag_dir):
        if RANK_FILE.fullmatch(name) and name not in kept:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(tag_dir, name))


def remove_dead_temps(save_dir: str) -> None:
    """Dead writers' temporary files (`remove_if_dead`) in `save_dir` and every tag directory in it: a save killed
    under a tag that is never saved again would keep them (a data file's size each) for good. Best effort."""
    try:
        dirs = [save_dir, *(entry.path for entry in os.scandir(save_dir) if entry.is_dir(follow_symlinks=False))]
    except OSError:
        return
    for directory in dirs:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            remove_if_dead(os.path.join(directory, name))


def remove_if_dead(path: str) -> None:
    """Remove `path` if it is a temporary file (AtomicFile's) whose writer is gone: its name says this host and a
    pid that runs no more, and its lock, which a writing AtomicFile holds and the kernel drops when its process
    dies, can be taken (a writer in another pid namespace under the same host name still holds it)."""
    temp = TEMP_FILE.fullmatch(os.path.basename(path))
    if temp is None or temp["host"] != this_host() or pid_alive(int(temp["pid"])):
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)  # holding its lock: no writer has it
    except OSError:
        pass
    finally:
        os.close(fd)
