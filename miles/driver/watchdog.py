"""The driver's watchdog: when the driver dies, even by ``kill -9``, the processes it started die too.

A driver that starts its own local Ray cluster is the ancestor of every Ray process of the run (GCS, raylet, the
dashboard and runtime-env agents, the trainer workers). A clean exit shuts them down (``ray.shutdown``); after
``kill -9`` the raylet dies with its parent, but Ray's agents run on forever and its workers for half a minute more.
The watchdog is a small separate process, in a session of its own, that every half second records the driver's
descendants (pid and start time, read from ``/proc``); once the driver is gone it sends SIGKILL to each recorded
process that is still the same process, and to their descendants, then exits. It ends only processes it saw
descend from the driver (never a pid that was reused by someone else), and nothing when the driver joined a
cluster it did not start (``--ray-address``; that cluster ends the job's workers itself).

Linux only (``/proc``); elsewhere :func:`start_watchdog` does nothing. Run as
``python -m miles.driver.watchdog <driver pid> <driver start time>``; the module imports the standard library only.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["descendants", "process_start_time", "start_watchdog"]

POLL_S = 0.5


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None when there is
    no such process (or it is a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing parenthesis.
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        parents[int(entry.name)] = int(text[text.rindex(")") + 2 :].split()[1])
    return parents


def descendants(roots: set[int], parents: dict[int, int] | None = None) -> set[int]:
    """Every process whose chain of parents reaches one of ``roots`` (the roots excluded)."""
    parents = _parents() if parents is None else parents
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, stack = set(), list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found and child not in roots:
                found.add(child)
                stack.append(child)
    return found


def _alive(pid: int, start: int) -> bool:
    return process_start_time(pid) == start


def watch(driver_pid: int, driver_start: int) -> None:
    """Record the driver's descendants until the driver is gone, then end those still running (and theirs)."""
    known: dict[int, int] = {}
    while _alive(driver_pid, driver_start):
        for pid in descendants({driver_pid}):
            if pid != os.getpid() and pid not in known:
                start = process_start_time(pid)
                if start is not None:
                    known[pid] = start
        time.sleep(POLL_S)
    # Orphans of the driver now hang under init; their own children still point to them.
    for _ in range(3):
        victims = {pid: start for pid, start in known.items() if _alive(pid, start)}
        for pid in descendants(set(victims)):
            start = process_start_time(pid)
            if start is not None and pid != os.getpid():
                victims[pid] = start
        if not victims:
            return
        for pid, start in victims.items():
            if _alive(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        known.update(victims)
        time.sleep(POLL_S)


def start_watchdog() -> subprocess.Popen | None:
    """Start the watchdog of this process (the driver), or None where ``/proc`` is missing."""
    start = process_start_time(os.getpid())
    if start is None:
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "miles.driver.watchdog", str(os.getpid()), str(start)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: a Ctrl-C or SIGTERM to the driver's process group leaves it to clean up after them.
        start_new_session=True,
        close_fds=True,
    )


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
