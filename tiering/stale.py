"""Swap files left behind by processes that died without closing their store (kill -9, the OOM killer, a
crash): found when a store opens on the same nvme_path, reported, and removed only when provably stale.

A store's file is named `zt-<host>-<pid>-<8 hex digits>.swap` and its store holds an exclusive flock on it
for as long as it is open; the kernel drops the lock when the process dies. A file is provably stale when

1. its flock can be taken: no open store holds it, and
2. the process that made it is gone: its name says this host and that pid no longer runs (or is a zombie),
   or the pid now belongs to a process started after the file was last written (the pid was reused); a file
   of another host (a shared directory) qualifies only when nothing wrote to it for `grace` seconds. "Last
   written" is the file's mtime, which every write and growth of a store updates.

Rule 2 covers the instant between a store creating its file and taking the lock: that process is alive, so
its file is left alone. Everything else is left alone and reported: a locked file is live, an unlocked one
whose process runs may be opening, and a file not named like a store's is never looked at.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import socket
import time
import warnings
from dataclasses import dataclass, field

from .errors import fmt_bytes

SWAP_NAME = re.compile(r"^zt-(?P<host>.+)-(?P<pid>\d+)-(?P<rand>[0-9a-f]{8})\.swap$")
GRACE_SECONDS = 60.0
"""How long another host's unlocked file must have been untouched before it counts as stale."""
LOCKED = "locked: its store is open"
CLOCK_SLACK = 2.0
"""Seconds of doubt when comparing a file's times with a process's start (boot time has 1 s resolution)."""


class StaleSwapFileWarning(UserWarning):
    """A store found swap files of other processes in its nvme_path (removed or left; the message says)."""


@dataclass(frozen=True)
class SwapFile:
    path: str
    host: str
    pid: int
    size: int
    verdict: str
    """Why it was removed or kept, in words."""


@dataclass
class StaleReport:
    directory: str
    removed: list[SwapFile] = field(default_factory=list)
    """Provably stale files, now deleted."""
    kept: list[SwapFile] = field(default_factory=list)
    """Files of other processes left alone (live, possibly live, or not removable)."""

    @property
    def worth_telling(self) -> bool:
        """Anything removed, or left in doubt (a locked file is simply another store's, open)."""
        return bool(self.removed) or any(f.verdict != LOCKED for f in self.kept)

    def message(self) -> str:
        lines = [f"nvme_path {self.directory!r}: removed {len(self.removed)} stale swap file(s) "
                 f"({fmt_bytes(sum(f.size for f in self.removed))}) left by dead processes, "
                 f"left {len(self.kept)} of other processes"]
        for f in self.removed:
            lines.append(f"  removed {f.path} ({fmt_bytes(f.size)}): {f.verdict}")
        for f in self.kept:
            lines.append(f"  left {f.path} ({fmt_bytes(f.size)}): {f.verdict}")
        return "\n".join(lines)


def this_host() -> str:
    """The host as a store's file name spells it (store_file.swap_file_name calls this): the hostname with
    '-' made '_' (the name's fields are separated by '-'), or 'host' when it is empty."""
    return socket.gethostname().replace("-", "_") or "host"


def process_start(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), None if it does not exist or is a zombie.
    Raises OSError where /proc cannot tell (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime field 22
    if fields[0] in ("Z", "X"):
        return None
    with open("/proc/stat") as f:
        boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _verdict(host: str, pid: int, written: float, grace: float, now: float) -> str | None:
    """Why an unlocked file is stale, or None if it may still belong to a live process."""
    if host != this_host():
        if now - written > grace:
            return f"unlocked, made on host {host!r}, not written for {now - written:.0f} s"
        return None
    try:
        started = process_start(pid)
    except (OSError, ValueError, StopIteration, IndexError):
        return None if pid_alive(pid) else f"unlocked, process {pid} is gone"
    if started is None:
        return f"unlocked, process {pid} is gone"
    if written < started - CLOCK_SLACK:
        return f"unlocked, pid {pid} now belongs to a process started after the file was last written"
    return None


def scan(directory: str, *, own: str | None = None, remove: bool = True, grace: float = GRACE_SECONDS) -> StaleReport:
    """Look at every store-named swap file in `directory` but `own` (the caller's); remove (with `remove`) the
    provably stale ones. Never raises for a single file: what cannot be checked or removed is reported as kept."""
    directory = os.path.abspath(directory)
    report = StaleReport(directory)
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return report
    for name in names:
        match = SWAP_NAME.match(name)
        if match is None:
            continue
        host, pid = match["host"], int(match["pid"])
        path = os.path.join(directory, name)
        if own is not None and path == os.path.abspath(own):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue  # closed meanwhile
        except OSError as exc:
            report.kept.append(SwapFile(path, host, pid, 0, f"cannot open it: {exc.strerror}"))
            continue
        try:
            st = os.fstat(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    report.kept.append(SwapFile(path, host, pid, st.st_size, LOCKED))
                else:
                    report.kept.append(SwapFile(path, host, pid, st.st_size, f"cannot lock it: {exc.strerror}"))
                continue
            verdict = _verdict(host, pid, st.st_mtime, grace, time.time())
            if verdict is None:
                report.kept.append(SwapFile(path, host, pid, st.st_size,
                                            "unlocked, but the process that made it may still be running"))
                continue
            if not remove:
                report.kept.append(SwapFile(path, host, pid, st.st_size, f"stale ({verdict}); not removed"))
                continue
            try:
                current = os.stat(path, follow_symlinks=False)
                if (current.st_dev, current.st_ino) != (st.st_dev, st.st_ino):
                    continue  # the name now points at another file: not the one we judged
                os.unlink(path)  # while holding its lock: no store can be using it
            except FileNotFoundError:
                continue
            except OSError as exc:
                report.kept.append(SwapFile(path, host, pid, st.st_size, f"stale, but removing failed: {exc.strerror}"))
                continue
            report.removed.append(SwapFile(path, host, pid, st.st_size, verdict))
        finally:
            os.close(fd)
    return report


def sweep(directory: str, own: str | None = None) -> StaleReport:
    """What a store runs when it opens (after locking its own file `own`): scan and remove, and warn with
    StaleSwapFileWarning when it removed something or left a file in doubt (not for other stores' open files)."""
    report = scan(directory, own=own)
    if report.worth_telling:
        warnings.warn(report.message(), StaleSwapFileWarning, stacklevel=3)
    return report
