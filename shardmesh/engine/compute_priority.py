"""The scheduling priority of a worker's compute thread and its OpenMP team.

Why: an OpenMP team is as slow as its slowest thread. Whenever another thread runs on one of its cores during a
forward (a gRPC poller, a heartbeat, the other stage finishing its step, a stray build), the whole team waits at its
next barrier. CPU stages that take turns on shared cores (`shardmesh up`'s `turns`) suffer most: through live meshes
of SmolLM2 on 2 vCPUs, pp=2 took 1.07-1.15x pp=1's time per token, and 2.7x beside a `nice -n 19` busy loop. With
their compute threads at real-time priority (SCHED_RR 1), which no normal thread preempts, the same meshes measured
0.95-1.0x, and 0.99x beside the loop; pp=1 itself gained 2-6%. Why threads that sleep between turns lose so much
more than a team that never sleeps is not established; Linux's fair scheduler (EEVDF), which keeps a task's lag
across sleeps, is the suspect (docs/performance.md, "Real-time priority for the stages' compute threads").

`realtime` gives the calling thread SCHED_RR at the lowest real-time priority. Threads it creates afterwards
inherit the policy: call it on the compute thread before its first parallel region, and the OpenMP team libgomp
makes for that thread is real-time too; the worker's gRPC, heartbeat and health threads stay normal. (Not with
SCHED_RESET_ON_FORK: Linux applies it to every task the thread creates, threads included, and the team would start
normal.) Linux keeps 5% of each core for normal threads whatever real-time threads do (`unbounded` checks that it
does), and a worker sleeps at every decode call's end, when the gateway's next call comes. Under sustained load
the compute threads can still use up their share: at 16 streams on 2 vCPUs a compute thread was throttled for 21-29 ms
with its vCPU idle, about once in 2 s, which cost ~1-2% of throughput there (docs/performance.md, session 37).

It needs CAP_SYS_NICE or an RLIMIT_RTPRIO of at least 1 (`ulimit -r`; containers: `cap_add: [SYS_NICE]`), and a
cgroup that allows real-time threads. `refusal` says why not, tried on a throwaway thread.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

PRIORITIES = ("normal", "realtime")
RT_PRIORITY = 1  # the lowest real-time priority: above every normal thread, below anything the host's admin set
RT_RUNTIME = Path("/proc/sys/kernel/sched_rt_runtime_us")  # -1: real-time threads may hold a core indefinitely


def check(priority: str) -> str:
    if priority not in PRIORITIES:
        raise ValueError(f"must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    return priority


def apply(priority: str) -> None:
    """Give the calling thread `priority` ("normal": leave it as it is). Raises PermissionError (or OSError) with
    the OS's reason when it may not."""
    if check(priority) == "realtime":
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(RT_PRIORITY))


def current() -> str:
    """The calling thread's priority, as `apply` names it ("realtime" for any real-time policy)."""
    return "realtime" if os.sched_getscheduler(0) in (os.SCHED_RR, os.SCHED_FIFO) else "normal"


def refusal() -> str | None:
    """Why this process may not run a thread at real-time priority, or None when it may. Asked of the OS itself,
    on a thread that exits afterwards, because the answer depends on capabilities, rlimits and the cgroup alike."""
    if not hasattr(os, "sched_setscheduler"):
        return "this OS has no sched_setscheduler"
    why: list[str] = []

    def probe() -> None:
        try:
            apply("realtime")
        except OSError as e:
            why.append(f"{e.strerror or e} (needs CAP_SYS_NICE or `ulimit -r` >= {RT_PRIORITY})")

    t = threading.Thread(target=probe, name="rt-probe", daemon=True)
    t.start()
    t.join()
    return why[0] if why else None


def realtime_refused(priority: str) -> str | None:
    """Why asking for `priority` cannot be granted in this process, worded for `--compute-priority` (`shardmesh up` and
    `shardmesh worker` both refuse it as a usage error before anything starts), or None."""
    if priority == "realtime" and (why := refusal()) is not None:
        return f"--compute-priority realtime: this process may not use it: {why}"
    return None


def unbounded() -> str | None:
    """Why real-time threads would not leave normal ones any time on their cores, or None: Linux reserves 5% of each
    core for normal threads unless an administrator wrote -1 to sched_rt_runtime_us. A worker's heartbeats and
    health checks run on normal threads, so `auto` does not ask for real-time on such a host."""
    try:
        runtime = int(RT_RUNTIME.read_text())
    except (OSError, ValueError):  # not Linux's knob here: nothing known against it
        return None
    return f"{RT_RUNTIME} is -1, so real-time threads could starve the worker's own heartbeats" if runtime < 0 else None


def auto_refusal() -> str | None:
    """What keeps `--compute-priority auto` from asking for real-time: `unbounded`, then `refusal`."""
    return unbounded() or refusal()
