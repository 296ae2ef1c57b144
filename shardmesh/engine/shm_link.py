"""A pipeline link through a shared-memory segment, for two neighbouring stages (or a pipeline's two ends) on one host.

Over Gloo a message between two processes on one host crosses loopback TCP and wakes three threads: the receiver's
Gloo loop thread reads the socket and signals the thread waiting in `recv`, which then wakes its OpenMP team for the
next layer. Gloo's loop threads also wake every 10 ms while idle, about 100 times a second each, on the cores the
stages compute on. A decode step of a two-stage pipeline crosses two links (the activations forward, the drawn token
back), so on a 2-core host each hop cost ~0.2 ms of the step (`docs/performance.md`). Through a segment that both
sides map, a message is a copy and a futex wake-up: the waiting thread is woken directly by the sender's store.

Layout: a header (the nonce, and in its line the word in which a side that closed the link writes side + 1; then
the count of messages the sender has published and the count the receiver has consumed, each on its own cache line
with a 32-bit futex word beside it; then each slot's message size) and `slots` slots of `capacity` bytes, a ring:
message s (1-based) goes to slot (s - 1) % slots. The sender waits for room (consumed >= s - slots), copies, then
publishes s and wakes the receiver; the receiver waits until s is published, checks the size it expected, copies out,
publishes that it consumed s and wakes the sender. With several slots a sender runs ahead of a busy receiver, as a
socket's buffer lets it on Gloo (a `full` pipeline sends its next micro-batch while the next stage still computes);
so that it does not hand a message to a receiver that is gone, each send first checks that the receiver lives and
has not closed the link (Gloo's send fails on the closed socket the same way).
Messages larger than a slot go through in slot-sized chunks, one message each, so a prefill of thousands of tokens
uses the same ring.

A waiting side spins for `spin_s` (0 by default: on a host where the stages take turns on shared cores the peer
it waits for needs that core), then sleeps on the futex word for at most 10 ms at a time (a stage waits through the
other stage's whole turn, and each wake-up would take a core from it), after which it checks that its peer lives
(one poll() of a pidfd of it; kill(pid, 0) and /proc for a zombie where there is no pidfd) and the group timeout.
A peer that closes the link (its epoch broke) wakes it at once.
A CPU stage's decode step receives, and sends, inside its layers' call (`cpu_decode`): the call is handed `link_recv`'s
and `link_send`'s addresses and their arguments (`ShmLinkWire.native_recv`, `native_send`), and the wire counts and
raises after it (`moved_natively`).
Each failure returns a status that `ShmLinkWire` raises as RuntimeError naming the peer, as a broken Gloo link
would, and the worker treats it as a lost peer. The kernel is `shm_collective`'s prelude plus the functions
here, built at first use; without a C++ compiler the negotiation refuses and the link stays on Gloo.
"""

from __future__ import annotations

import math
import mmap
import os
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from shardmesh.engine import shm_collective
from shardmesh.engine.native import InlineKernel
from shardmesh.engine.shm_collective import LINE, PRELUDE, Segment

TRANSPORT_ENV = "SHARDMESH_LINK_TRANSPORT"  # auto (default), shm or gloo: a CPU pipeline link's transport
SLOTS = 4
CAPACITY = 256 << 10  # bytes per slot: 113 tokens of a 576-wide float32 hidden state, 16 of a 8192-wide bfloat16
HEAD_AT = LINE  # messages the sender published (int64), its futex word at +8
TAIL_AT = 2 * LINE  # messages the receiver consumed (int64), its futex word at +8
SIZES_AT = 3 * LINE  # each slot's message size (int64 per slot)
MAX_SLOTS = (mmap.PAGESIZE - SIZES_AT) // 8
DEAD, CLOSED, TIMED_OUT = 1, 2, 3  # the kernel's statuses; MISMATCH + n: the sender's message held n bytes
MISMATCH = 16

_SOURCE = r"""
#include <climits>
#include <linux/futex.h>
#include <poll.h>
#include <sys/syscall.h>

namespace {

constexpr int64_t HEAD_AT = LINE, TAIL_AT = 2 * LINE, SIZES_AT = 3 * LINE;
// How long a waiting side sleeps on the futex before it checks its peer's liveness and the timeout. Not CHECK_S: a
// stage waits here for a whole turn of the other stage's compute (tens of ms), and every wake-up of this process
// takes a core from the threads computing in that turn. A close wakes it at once (link_close).
constexpr double LINK_CHECK_S = 10e-3;
constexpr int64_t DEAD = 1, CLOSED = 2, TIMED_OUT = 3, MISMATCH = 16;

// Gone: with a pidfd of the peer (Linux 5.3+, -1 without), one poll(), readable once it exited, zombie or reaped;
// peer_dead's kill() and read of /proc cost ~12 us, paid before every send.
bool peer_gone(int64_t pid, int64_t pidfd) {
  if (pidfd >= 0) {
    pollfd p{static_cast<int>(pidfd), POLLIN, 0};
    const int ready = poll(&p, 1, 0);
    if (ready >= 0) return ready > 0;
  }
  return peer_dead(pid);
}

inline std::atomic<int64_t>* count_at(uint8_t* base, int64_t at) {
  return reinterpret_cast<std::atomic<int64_t>*>(base + at);
}
inline std::atomic<int32_t>* word_at(uint8_t* base, int64_t at) {  // the futex word beside a count
  return reinterpret_cast<std::atomic<int32_t>*>(base + at + 8);
}

void wake(std::atomic<int32_t>* word) {
  word->fetch_add(1, std::memory_order_release);
  syscall(SYS_futex, reinterpret_cast<int32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void publish(uint8_t* base, int64_t at, int64_t value) {
  count_at(base, at)->store(value, std::memory_order_release);
  wake(word_at(base, at));
}

// Wait until the count at `at` reaches `target`: 0, or DEAD, CLOSED (the peer closed the link), TIMED_OUT.
// The futex word is read before the count, and the publisher stores the count before bumping the word: a count
// published after our check changes the word, so FUTEX_WAIT returns at once instead of sleeping through it.
int64_t wait_for(uint8_t* base, int64_t at, int64_t target, int64_t peer_pid, int64_t peer_fd, double spin_s,
                 double timeout_s) {
  std::atomic<int64_t>* count = count_at(base, at);
  std::atomic<int32_t>* word = word_at(base, at);
  std::atomic<int64_t>* closed = count_at(base, CLOSED_AT);
  if (count->load(std::memory_order_acquire) >= target) return 0;
  const auto start = Clock::now();
  double next_check = LINK_CHECK_S;
  uint64_t spins = 0;
  while (true) {
    if (spin_s > 0 && (++spins & 63) != 0) {
      cpu_relax();
      if (count->load(std::memory_order_acquire) >= target) return 0;
      continue;
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    if (elapsed < spin_s) continue;
    if (closed->load(std::memory_order_acquire) > 0) return CLOSED;  // link_close wakes us to read it
    if (elapsed >= next_check) {
      next_check = elapsed + LINK_CHECK_S;
      if (peer_gone(peer_pid, peer_fd)) return DEAD;
      if (elapsed >= timeout_s) return TIMED_OUT;
    }
    const int32_t seen = word->load(std::memory_order_acquire);
    if (count->load(std::memory_order_acquire) >= target) return 0;
    timespec ts{0, static_cast<long>(LINK_CHECK_S * 1e9)};
    syscall(SYS_futex, reinterpret_cast<int32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
    if (count->load(std::memory_order_acquire) >= target) return 0;
  }
}

uint8_t* slot_at(uint8_t* base, int64_t data_offset, int64_t capacity, int64_t slots, int64_t s) {
  return base + data_offset + ((s - 1) % slots) * capacity;
}

}  // namespace

// Send x's bytes as messages seq + 1, seq + 2, ... (one per `capacity` bytes, at least one).
int64_t link_send(torch::Tensor seg, torch::Tensor x, int64_t seq, int64_t slots, int64_t capacity,
                  int64_t data_offset, int64_t peer_pid, int64_t peer_fd, double spin_s, double timeout_s) {
  uint8_t* base = seg.data_ptr<uint8_t>();
  const uint8_t* src = static_cast<const uint8_t*>(x.data_ptr());
  const int64_t nbytes = x.numel() * x.element_size();
  const int64_t chunks = nbytes == 0 ? 1 : (nbytes + capacity - 1) / capacity;
  // The ring would take a message for a receiver that is gone (Gloo's send fails on the closed socket): check first.
  if (count_at(base, CLOSED_AT)->load(std::memory_order_acquire) > 0) return CLOSED;
  if (peer_gone(peer_pid, peer_fd)) return DEAD;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t s = seq + 1 + c;
    // room in the ring
    const int64_t status = wait_for(base, TAIL_AT, s - slots, peer_pid, peer_fd, spin_s, timeout_s);
    if (status != 0) return status;
    const int64_t len = std::min(capacity, nbytes - c * capacity);
    std::memcpy(slot_at(base, data_offset, capacity, slots, s), src + c * capacity, len);
    count_at(base, SIZES_AT + 8 * ((s - 1) % slots))->store(len, std::memory_order_relaxed);
    publish(base, HEAD_AT, s);
  }
  return 0;
}

// Receive messages seq + 1, ... into out (contiguous), whose size says what the sender must have sent.
int64_t link_recv(torch::Tensor seg, torch::Tensor out, int64_t seq, int64_t slots, int64_t capacity,
                  int64_t data_offset, int64_t peer_pid, int64_t peer_fd, double spin_s, double timeout_s) {
  uint8_t* base = seg.data_ptr<uint8_t>();
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  const int64_t nbytes = out.numel() * out.element_size();
  const int64_t chunks = nbytes == 0 ? 1 : (nbytes + capacity - 1) / capacity;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t s = seq + 1 + c;
    const int64_t status = wait_for(base, HEAD_AT, s, peer_pid, peer_fd, spin_s, timeout_s);
    if (status != 0) return status;
    const int64_t len = std::min(capacity, nbytes - c * capacity);
    const int64_t sent = count_at(base, SIZES_AT + 8 * ((s - 1) % slots))->load(std::memory_order_relaxed);
    if (sent != len) return MISMATCH + sent;
    std::memcpy(dst + c * capacity, slot_at(base, data_offset, capacity, slots, s), len);
    publish(base, TAIL_AT, s);
  }
  return 0;
}

// link_recv's and link_send's addresses, for a kernel of another extension that waits for its input inside the call it
// computes in, and sends its output from there (`cpu_kernels.decode_layers_received`).
int64_t link_recv_address() { return reinterpret_cast<int64_t>(&link_recv); }
int64_t link_send_address() { return reinterpret_cast<int64_t>(&link_send); }

// Mark the link closed by `side` and wake whichever side waits, so it reads the mark now.
void link_close(torch::Tensor seg, int64_t side) {
  uint8_t* base = seg.data_ptr<uint8_t>();
  count_at(base, CLOSED_AT)->store(side + 1, std::memory_order_release);
  wake(word_at(base, HEAD_AT));
  wake(word_at(base, TAIL_AT));
}
"""

_KERNEL = InlineKernel(
    "shardmesh_link",
    PRELUDE + _SOURCE,
    ["link_send", "link_recv", "link_recv_address", "link_send_address", "link_close"],
    ["-O3"],
)


def pidfd(pid: int) -> int:
    """A pidfd of process `pid` (Linux 5.3+; its holder closes it), or -1 where none can be had (an older kernel, a
    seccomp filter, a peer already reaped, or this process itself: ranks as threads of one process). The kernel then
    checks the peer with kill() and /proc."""
    if pid == os.getpid() or not hasattr(os, "pidfd_open"):
        return -1
    try:
        return os.pidfd_open(pid)
    except OSError:
        return -1


def data_offset() -> int:
    """Where the slots start: after the header's page."""
    return mmap.PAGESIZE


def segment_bytes(slots: int = SLOTS, capacity: int = CAPACITY) -> int:
    return data_offset() + slots * capacity


def transport() -> str:
    """The pipeline-link transport asked for in $SHARDMESH_LINK_TRANSPORT: "auto" (shared memory when both sides can
    map one segment, else Gloo), "shm" (shared memory, or an error) or "gloo"."""
    return shm_collective.transport_from_env(TRANSPORT_ENV)


class ShmLinkWire:
    """One side of a two-process link over a mapped segment (see the module docstring): `send` on side 0, `recv_into`
    on side 1, each blocking until its copy is done. After a failure the link is broken and every later call raises
    (the sides may disagree on how many messages went through); the next topology forms a new one."""

    def __init__(self, segment: Segment, side: int, peer_pid: int, timeout: timedelta, slots: int = SLOTS,
                 capacity: int = CAPACITY, spin_s: float = 0.0) -> None:  # fmt: skip
        if side not in (0, 1):
            raise ValueError(f"a link has sides 0 and 1, got {side}")
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"a shared-memory link has 1 to {MAX_SLOTS} slots, got {slots}")
        ext = _KERNEL.module()
        if ext is None:
            raise RuntimeError(f"shared-memory links need their C++ kernel: {_KERNEL.build_error}")
        self._ext = ext
        self.segment, self.side, self.peer_pid = segment, side, peer_pid
        self.slots, self.capacity, self.spin_s = slots, capacity, spin_s
        self.timeout_s = timeout.total_seconds()
        self.peer_fd = pidfd(peer_pid)
        if self.peer_fd >= 0:
            weakref.finalize(self, os.close, self.peer_fd)
        self._seg = torch.frombuffer(segment.mm, dtype=torch.uint8)
        self._seq = 0  # messages through the ring so far, counted alike on both sides
        self._broken = ""
        # What a C++ caller of another extension calls to move a message itself (`native_recv`, `native_send`).
        self._addresses = {"recv": ext.link_recv_address(), "send": ext.link_send_address()}

    def describe(self) -> str:
        return f"shm ({self.slots} x {self.capacity >> 10} KiB slots)"

    def send(self, x: Tensor) -> None:
        self._run("send", self._ext.link_send, x)

    def recv_into(self, out: Tensor) -> None:
        self._run("recv", self._ext.link_recv, out)

    def native_recv(self, nbytes: int) -> tuple[Any, ...] | None:
        """What a C++ caller passes to `link_recv` after the tensor it receives into (of `nbytes`), led by the
        kernel's address; then `moved_natively`. None when that would not come in one message (the caller receives
        through `recv_into`). Raises as `recv_into` would on a link that broke earlier."""
        return self._native("recv", nbytes)

    def native_send(self, nbytes: int) -> tuple[Any, ...] | None:
        """`native_recv` for `link_send`: what a C++ caller passes after a tensor of `nbytes` it sends."""
        return self._native("send", nbytes)

    def moved_natively(self, what: str, status: int, nbytes: int, seconds: float) -> None:
        """After a C++ caller received or sent (`what`) one message of `nbytes` with `native_recv`'s or
        `native_send`'s arguments in `seconds`, which returned `status`: the sequence moves on, and a failure raises
        (and breaks the link) as `recv_into` or `send` would."""
        self._seq += 1
        if status != 0:
            self._failed(what, status, nbytes, seconds)

    def _native(self, what: str, nbytes: int) -> tuple[Any, ...] | None:
        self._check_unbroken(what)
        return None if nbytes > self.capacity else (self._addresses[what], self._seg, *self._ring_args())

    def _check_unbroken(self, what: str) -> None:
        if self._broken:
            raise RuntimeError(f"link {what} over shm: the link broke earlier ({self._broken})")

    def _ring_args(self) -> tuple[Any, ...]:
        """`link_send`'s and `link_recv`'s arguments after the segment and the tensor moved."""
        return (self._seq, self.slots, self.capacity, data_offset(), self.peer_pid, self.peer_fd, self.spin_s,
                self.timeout_s)  # fmt: skip

    def close(self, why: str) -> None:
        """Mark the link closed in the segment and wake the peer: if it waits on the link, it raises now."""
        if not self._broken:
            self._broken = f"side {self.side} closed the link: {why}"
            self._ext.link_close(self._seg, self.side)

    def _run(self, what: str, fn: Any, x: Tensor) -> None:
        self._check_unbroken(what)
        if x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError(f"a shared-memory link moves contiguous host tensors, got {x.device} "
                             f"contiguous={x.is_contiguous()}")  # fmt: skip
        nbytes = x.numel() * x.element_size()
        t0 = time.perf_counter()
        status = fn(self._seg, x, *self._ring_args())
        self._seq += max(1, math.ceil(nbytes / self.capacity))
        if status != 0:
            self._failed(what, status, nbytes, time.perf_counter() - t0)

    def _failed(self, what: str, status: int, nbytes: int, waited: float) -> None:
        peer = f"side {1 - self.side} (pid {self.peer_pid})"
        if status == DEAD:
            why = f"{peer} died while side {self.side} waited {waited:.3f} s"
        elif status == CLOSED:
            why = f"{peer} closed the link (its epoch broke) while side {self.side} waited {waited:.3f} s"
        elif status == TIMED_OUT:
            why = (f"{peer} did not come within the group timeout of {self.timeout_s:g} s (--group-timeout); "
                   f"side {self.side} waited {waited:.3f} s")  # fmt: skip
        else:
            why = f"{peer} sent {status - MISMATCH} bytes where side {self.side} expected a message of {nbytes}"
        self._broken = why
        raise RuntimeError(f"link {what} #{self._seq} over shm: {why}")


def negotiate(store: dist.Store, prefix: str, side: int, timeout: timedelta,
              wanted: str = "auto") -> tuple[ShmLinkWire | None, str]:  # fmt: skip
    """Whether both sides of a link can map one segment (`shm_collective.agree`, side 0 creating it): a ShmLinkWire
    when they can, else None and the reason. `wanted` "gloo" makes this side refuse (and so both)."""
    # Built before any wait (a worker builds it while loading: `groups.build_transport_kernels`); no tp kernel needed.
    refusal = f"{TRANSPORT_ENV}=gloo" if wanted == "gloo" else _unavailable()
    segment, pids, reason = shm_collective.agree(store, prefix, side, 2, timeout, refusal, segment_bytes(), "link")
    if segment is None:
        return None, reason
    return ShmLinkWire(segment, side, pids[1 - side], timeout), ""


def available() -> bool:
    """Whether the kernel is built (building it now if it is not cached)."""
    return _KERNEL.module() is not None


def _unavailable() -> str:
    if not available():
        return f"no C++ build of the shm link kernel ({_KERNEL.build_error})"
    return ""
