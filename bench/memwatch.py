"""Run a command and record the peak memory of every process it starts; and the benches'
other memory readings from /proc (`status_bytes`, `mem_available`).

    python -m bench.memwatch --out peaks.json -- CMD ARGS...

Polls /proc every 20 ms for the command and all its descendants; for each process it keeps the
peak of its resident anonymous memory (RssAnon: what the process allocated itself) and of its
whole resident set (VmRSS: also file pages it maps, e.g. shared libraries and memory-mapped
checkpoint files, which the kernel can drop). A process whose environment has RANK is reported
under that rank. Linux only. Exits with the command's exit status.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

KIB = 1024

# A command whose run is this module's smallest (tests/bench/test_every_bench.py).
TINY_ARGS = ["--out", "{tmp}/peaks.json", "--", "{python}", "-c", "pass"]


def status_bytes(field: str, pid: int | str = "self") -> int:
    """One memory field of /proc/PID/status in bytes: VmRSS (resident now), VmHWM (this
    address space's peak), RssAnon (what the process allocated itself). Raises KeyError if
    the field is missing, OSError if the process is gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == field:
            return int(value.split()[0]) * KIB
    raise KeyError(f"{field} not in /proc/{pid}/status (these benches need Linux)")


def mem_available() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * KIB
    raise KeyError("MemAvailable not in /proc/meminfo")


def _children(pid: int) -> list[int]:
    """The children of every thread of `pid`; none if it has exited meanwhile (Python 3.11's
    glob raises for the vanished /proc/PID/task)."""
    out = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _tree(root: int) -> list[int]:
    todo, seen = [root], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += _children(pid)
    return seen


def _status(pid: int) -> dict[str, int]:
    """RssAnon and VmRSS of `pid` in bytes; empty if it has exited meanwhile."""
    try:
        return {key: status_bytes(key, pid) for key in ("RssAnon", "VmRSS")}
    except (OSError, KeyError):
        return {}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
    except OSError:
        return ""


def _label(pid: int, cmd: str) -> str:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    rank = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), None)
    return f"rank {rank}" if rank is not None and "train.py" in cmd else f"pid {pid}: {cmd}"


def watch(cmd: list[str], interval: float = 0.02) -> tuple[int, dict[str, dict[str, int]], float]:
    """Run `cmd`; return (exit status, {label: {"anon": peak, "rss": peak}}, seconds).

    A process is labelled by what it runs now: a child forked by a rank (a compiler, a loader
    worker) looks like the rank until it execs, and is counted as itself from then on."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    peaks: dict[str, dict[str, int]] = {}
    labels: dict[tuple[int, str], str] = {}
    while proc.poll() is None:
        for pid in _tree(proc.pid):
            fields, command = _status(pid), _cmdline(pid)
            if not fields:
                continue
            if (pid, command) not in labels:
                labels[pid, command] = _label(pid, command)
            peak = peaks.setdefault(labels[pid, command], {"anon": 0, "rss": 0})
            peak["anon"] = max(peak["anon"], fields.get("RssAnon", 0))
            peak["rss"] = max(peak["rss"], fields.get("VmRSS", 0))
        time.sleep(interval)
    return proc.returncode, peaks, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the peaks (bytes)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command after --")
    status, peaks, seconds = watch(cmd)
    Path(args.out).write_text(json.dumps({"exit": status, "seconds": seconds, "peaks": peaks},
                                         indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
