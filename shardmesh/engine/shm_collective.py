"""Tensor-parallel collectives through a shared-memory segment, for the ranks of a group that share a host.

Over Gloo every all-reduce of a decode step crosses loopback TCP (about 0.6 ms each, two per layer); through a
segment in /dev/shm that every rank maps it is a copy, one barrier and a sum. Rank 0 creates the segment and every
rank maps it while the group forms (`negotiate`, called by `groups.form_groups`); it is unlinked as soon as all
ranks have mapped it (or given up), so no file is left in /dev/shm even when a rank is later killed.

Layout: a header (a nonce that proves a rank mapped the segment rank 0 created and, in the same line, the word in
which a rank that closed the group writes its rank + 1; then one sequence counter per rank, each on its own cache
line) and two buffers of `size` slots of `capacity` bytes each. Collective n uses buffer
n % 2: every rank copies its input into its own slot, publishes n in its counter (release), waits until every
counter reads at least n (acquire), then sums all slots in rank order 0..size-1 (every rank adds the same numbers
in the same order, so every rank gets the same bits), or concatenates them for an all-gather.

Why one barrier per collective is enough with two buffers: a rank writes buffer n % 2 again only in collective
n + 2, after its wait of collective n + 1 saw every rank publish n + 1; a rank publishes n + 1 only after it has
finished reading the slots of collective n. So nobody overwrites a slot that someone still reads. (With one buffer,
a fast rank could overwrite its slot of collective n + 1 while a slow one still sums collective n.)

Tensors bigger than a slot go through in slot-sized chunks, one collective each (all-reduce: any split of the flat
tensor; all-gather: whole rows), rather than growing the segment or falling back to Gloo: the segment stays small
(/dev/shm is 64 MiB in a default container) and a prefill of thousands of tokens keeps the same transport and the
same rank-order sum. Only an all-gather whose single row exceeds a slot, or a dtype other than float32 and
bfloat16, goes over the wrapped Gloo group.

The wait and the sums are C++ (std::atomic on the mapped memory; the sums vectorized for this CPU), built at first
use like `int8_cpu`. The wait is a short spin with the pause instruction, then sched_yield, then short sleeps, so
that a host with fewer cores than ranks still makes progress. On such a host a rank does not spin at all
(`spin_seconds`): the peer it waits for may be queued on its core, and spinning only delays it (SmolLM2 tp=3 on 2
cores, a decode step in process: bfloat16 14.2 ms with a 50 µs spin, 11.1 ms yielding at once; float32 22.5 against
19.3). Every millisecond it checks that each peer it
waits for is alive (kill(pid, 0), and not a zombie) and that the group timeout has not passed; either failure raises
RuntimeError naming the peer, as a broken Gloo group would, and the worker treats it as a lost peer. So does a
peer's `close` (its epoch broke: it lost a peer of its own, or a step failed part-way on it), which it writes into
the header: a live peer that will never arrive. Without a C++ compiler the kernel is not built and `negotiate`
reports shm as unavailable, so every rank keeps Gloo.

A kernel of another extension may make a group's all-reduces itself (`cpu_kernels.decode_layers_reduced`, a
tensor-parallel rank's layers in one call): `native_all_reduce_add` hands it `shm_all_reduce_add`'s address and
arguments, its collectives number on from the group's, and `reduced_natively` moves the group's sequence and
counters on by how many it made and raises on a failure as `all_reduce_add` does.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from shardmesh.core import device_map
from shardmesh.engine.native import InlineKernel

SHM_DIR = Path("/dev/shm")
DEFAULT_CAPACITY = 1 << 20  # bytes per slot: 455 tokens of a 576-wide float32 hidden state in one collective
NONCE_BYTES = 16
LINE = 64  # one cache line per rank's counter: ranks publishing at once do not contend for a line
TRANSPORT_ENV = "SHARDMESH_TP_TRANSPORT"  # auto (default), shm or gloo: a CPU tp group's transport
TRANSPORTS = ("auto", "shm", "gloo")
SUPPORTED = {torch.float32: 0, torch.bfloat16: 1}  # dtype -> the kernel's dtype code

# What the collectives here and the pipeline links (`shm_link`) share: waiting politely, and telling a dead peer.
PRELUDE = r"""
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t LINE = 64;
constexpr double YIELD_S = 2e-3;     // then hand the core over while the peer may need it (oversubscribed host)
constexpr long SLEEP_NS = 50000;     // then sleep: a peer that is this late is computing, not about to arrive
constexpr double CHECK_S = 1e-3;     // how often peers' liveness, the group's closing and the timeout are checked
constexpr int64_t CLOSED_AT = 56;    // the word in the nonce's line where a rank that closed the group writes rank + 1

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Gone: no such process, or a zombie (killed but not yet reaped by its parent, which kill(pid, 0) still finds).
bool peer_dead(int64_t pid) {
  if (pid == static_cast<int64_t>(getpid())) return false;  // ranks as threads of one process
  if (kill(static_cast<pid_t>(pid), 0) == -1 && errno == ESRCH) return true;
  char path[64];
  snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = fopen(path, "r");
  if (f == nullptr) return false;  // no /proc: kill(pid, 0) is all we can tell
  char buf[512];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  const char* paren = strrchr(buf, ')');  // the command name may hold spaces and parentheses
  return paren != nullptr && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

}  // namespace
"""

_SOURCE = r"""
namespace {

constexpr int64_t CLOSED = 1 << 20;  // barrier(): CLOSED + p, rank p closed the group
constexpr int64_t NOT_CARRIED = -(1 << 21);  // shm_all_reduce_add: not for the segment (no rank waited)

inline std::atomic<int64_t>* counter(uint8_t* base, int64_t r) {
  return reinterpret_cast<std::atomic<int64_t>*>(base + LINE * (1 + r));
}

// Publish `seq` and wait until every rank has: spin for `spin_s` (0: yield at once), then yield, then sleep.
// 0: all did; p + 1: peer p died; CLOSED + p: peer p closed the group; -(p + 1): timed out waiting on p.
int64_t barrier(uint8_t* base, int64_t rank, int64_t size, int64_t seq, const int64_t* pids, double spin_s,
                double timeout_s) {
  counter(base, rank)->store(seq, std::memory_order_release);
  const auto start = Clock::now();
  double next_check = CHECK_S;
  int64_t waiting = 0;  // peers before this one have published
  uint64_t spins = 0;
  while (true) {
    while (waiting < size && counter(base, waiting)->load(std::memory_order_acquire) >= seq) ++waiting;
    if (waiting == size) return 0;
    if (spin_s > 0 && (++spins & 63) != 0) {  // the clock costs more than a pause: read it every 64 tries
      cpu_relax();
      continue;
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    if (elapsed < spin_s) {
      cpu_relax();
    } else if (elapsed < YIELD_S) {
      sched_yield();
    } else {
      timespec ts{0, SLEEP_NS};
      nanosleep(&ts, nullptr);
    }
    if (elapsed >= next_check) {
      next_check = elapsed + CHECK_S;
      const int64_t closer = reinterpret_cast<std::atomic<int64_t>*>(base + CLOSED_AT)->load(std::memory_order_acquire);
      if (closer > 0) return CLOSED + closer - 1;
      for (int64_t p = waiting; p < size; ++p) {
        if (counter(base, p)->load(std::memory_order_acquire) < seq && peer_dead(pids[p])) return p + 1;
      }
      if (elapsed >= timeout_s) return -(waiting + 1);
    }
  }
}

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch rounds; a NaN as torch's 0x7fc0
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : static_cast<uint16_t>(rounded);  // a select: no branch to vectorize
}

uint8_t* slot(uint8_t* base, int64_t data_offset, int64_t capacity, int64_t size, int64_t seq, int64_t r) {
  return base + data_offset + ((seq & 1) * size + r) * capacity;
}

inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_to_float(v); }
template <typename T> T narrow(float v);
template <> float narrow<float>(float v) { return v; }
template <> uint16_t narrow<uint16_t>(float v) { return float_to_bf16(v); }

// Values summed at a time, in float32 on the stack (2 KiB, in L1).
constexpr int64_t SUM_CHUNK = 512;

// out[i] := the rank-order sum of every rank's slot (float32 or bfloat16 as uint16_t), summed in float32 and rounded
// to T once; with `residual`, residual[i] + that sum, rounded again: as torch rounds `x + all_reduce(partial)`. A
// chunk of values at a time, one rank after another, so that each loop runs over contiguous values and the compiler
// vectorizes it; each value's additions keep rank order. The loop over ranks inside the loop over values had stayed
// scalar: a bfloat16 all-reduce of 16 rows of 576 took 32 us, 61 of them a SmolLM2 step on each tp rank
// (docs/performance.md).
template <typename T>
void reduce_slots(uint8_t* base, int64_t data_offset, int64_t capacity, int64_t size, int64_t seq, int64_t n, T* out,
                  const T* residual) {
  const T* s[64];
  for (int64_t r = 0; r < size; ++r) s[r] = reinterpret_cast<const T*>(slot(base, data_offset, capacity, size, seq, r));
  alignas(64) float acc[SUM_CHUNK];
  for (int64_t i0 = 0; i0 < n; i0 += SUM_CHUNK) {
    const int64_t c = std::min(SUM_CHUNK, n - i0);
    const T* first = s[0] + i0;
    for (int64_t i = 0; i < c; ++i) acc[i] = widen(first[i]);
    for (int64_t r = 1; r < size; ++r) {
      const T* rank = s[r] + i0;
      for (int64_t i = 0; i < c; ++i) acc[i] += widen(rank[i]);
    }
    T* o = out + i0;
    if (residual == nullptr) {
      for (int64_t i = 0; i < c; ++i) o[i] = narrow<T>(acc[i]);
    } else {
      const T* res = residual + i0;
      for (int64_t i = 0; i < c; ++i) o[i] = narrow<T>(widen(res[i]) + widen(narrow<T>(acc[i])));
    }
  }
}

}  // namespace

// x (in and out, contiguous, at most `capacity` bytes): the sum over ranks, in rank order. dtype 0 float32, 1 bf16.
int64_t shm_all_reduce(torch::Tensor seg, torch::Tensor x, int64_t dtype, int64_t rank, int64_t size, int64_t seq,
                       int64_t capacity, int64_t data_offset, torch::Tensor pids, double spin_s, double timeout_s) {
  uint8_t* base = seg.data_ptr<uint8_t>();
  const int64_t* pid = pids.data_ptr<int64_t>();
  const int64_t n = x.numel();
  void* data = x.data_ptr();
  std::memcpy(slot(base, data_offset, capacity, size, seq, rank), data, n * x.element_size());
  const int64_t status = barrier(base, rank, size, seq, pid, spin_s, timeout_s);
  if (status != 0) return status;
  if (dtype == 0) {
    reduce_slots<float>(base, data_offset, capacity, size, seq, n, static_cast<float*>(data), nullptr);
  } else {
    reduce_slots<uint16_t>(base, data_offset, capacity, size, seq, n, static_cast<uint16_t*>(data), nullptr);
  }
  return 0;
}

// partial := x + the sum of every rank's partial (in rank order), each rounded as `x + all_reduce(partial)` rounds
// it in torch: a row-parallel product's end and the residual in one call, without the add's dispatch and tensor
// (60 a token for SmolLM2 at tp=3, ~3 us each). NOT_CARRIED, before any rank waits, unless both are contiguous host
// tensors of one supported dtype and size, at most `capacity` bytes: the caller then goes the long way.
int64_t shm_all_reduce_add(torch::Tensor seg, torch::Tensor partial, torch::Tensor x, int64_t rank, int64_t size,
                           int64_t seq, int64_t capacity, int64_t data_offset, torch::Tensor pids, double spin_s,
                           double timeout_s) {
  const auto dtype = partial.scalar_type();
  if ((dtype != torch::kFloat && dtype != torch::kBFloat16) || x.scalar_type() != dtype ||
      x.numel() != partial.numel() || !partial.is_contiguous() || !x.is_contiguous() || !partial.device().is_cpu() ||
      !x.device().is_cpu() || partial.numel() * partial.element_size() > capacity) {
    return NOT_CARRIED;
  }
  uint8_t* base = seg.data_ptr<uint8_t>();
  const int64_t* pid = pids.data_ptr<int64_t>();
  const int64_t n = partial.numel();
  void* data = partial.data_ptr();
  const void* residual = x.data_ptr();
  std::memcpy(slot(base, data_offset, capacity, size, seq, rank), data, n * partial.element_size());
  const int64_t status = barrier(base, rank, size, seq, pid, spin_s, timeout_s);
  if (status != 0) return status;
  if (dtype == torch::kFloat) {
    reduce_slots(base, data_offset, capacity, size, seq, n, static_cast<float*>(data),
                 static_cast<const float*>(residual));
  } else {
    reduce_slots(base, data_offset, capacity, size, seq, n, static_cast<uint16_t*>(data),
                 static_cast<const uint16_t*>(residual));
  }
  return 0;
}

// shm_all_reduce_add's address, for a kernel of another extension that runs a tensor-parallel shard's layers in one
// call (`cpu_kernels.decode_layers_reduced`): its all-reduces between the layers' halves then need no return to Python.
int64_t shm_all_reduce_add_address() { return reinterpret_cast<int64_t>(&shm_all_reduce_add); }

// x (rows, d) contiguous, at most `capacity` bytes; out (rows, size * d): every rank's rows side by side.
int64_t shm_all_gather(torch::Tensor seg, torch::Tensor x, torch::Tensor out, int64_t rank, int64_t size,
                       int64_t seq, int64_t capacity, int64_t data_offset, torch::Tensor pids, double spin_s,
                       double timeout_s) {
  uint8_t* base = seg.data_ptr<uint8_t>();
  const int64_t* pid = pids.data_ptr<int64_t>();
  const int64_t rows = x.size(0), row_bytes = x.size(1) * x.element_size();
  const void* in = x.data_ptr();
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  std::memcpy(slot(base, data_offset, capacity, size, seq, rank), in, rows * row_bytes);
  const int64_t status = barrier(base, rank, size, seq, pid, spin_s, timeout_s);
  if (status != 0) return status;
  for (int64_t r = 0; r < size; ++r) {
    const uint8_t* s = slot(base, data_offset, capacity, size, seq, r);
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(dst + (i * size + r) * row_bytes, s + i * row_bytes, row_bytes);
    }
  }
  return 0;
}
"""

_KERNEL = InlineKernel("shardmesh_shm", PRELUDE + _SOURCE,
                       ["shm_all_reduce", "shm_all_reduce_add", "shm_all_reduce_add_address", "shm_all_gather"],
                       ["-O3", "-march=native"])  # fmt: skip
NOT_CARRIED = -(1 << 21)  # the kernel's: shm_all_reduce_add was handed tensors the segment does not carry
MAX_RANKS = 64  # the slots' sum (reduce_slots) keeps one pointer per rank on the stack
CLOSED_AT = 56  # the kernel's CLOSED_AT: the byte of the header where a rank that closed the group writes rank + 1
CLOSED = 1 << 20  # the kernel's CLOSED: a barrier's status CLOSED + p says rank p closed the group
SPIN_S = 50e-6  # a waiting rank's spin before it yields, with a core per rank: a peer usually arrives within it


def available() -> bool:
    """Whether the kernel is built (building it now if it is not cached)."""
    return _KERNEL.module() is not None


def build_error() -> str:
    """Why the kernel could not be built ("" when it was, or was not tried)."""
    return _KERNEL.build_error


class Fallback(Protocol):
    """What a ShmCollective hands the collectives it does not do itself to (a `groups.GroupCollective`)."""

    def all_reduce(self, x: Tensor) -> Tensor: ...

    def all_gather(self, x: Tensor) -> Tensor: ...

    def close(self, why: str) -> None: ...


def spin_seconds(size: int, cores: int | None = None) -> float:
    """How long a rank waiting in a collective spins before it yields its core: SPIN_S when the group has a core
    per rank, 0 when it does not (`cores`: this process's, by default), since then the peer it waits for may be
    queued behind it on its own core, and every microsecond of spinning delays that peer by as much."""
    return SPIN_S if size <= (device_map.cores() if cores is None else cores) else 0.0


def data_offset(size: int) -> int:
    """Where the slots start: after the nonce's line and one line per rank, page-aligned."""
    return math.ceil(LINE * (1 + size) / mmap.PAGESIZE) * mmap.PAGESIZE


def segment_bytes(size: int, capacity: int) -> int:
    return data_offset(size) + 2 * size * capacity


@dataclass
class Segment:
    """One mapping of a group's segment; `name` is its file in SHM_DIR (unlinked once every rank mapped it)."""

    name: str
    nonce: bytes
    mm: mmap.mmap

    def close(self) -> None:
        self.mm.close()


def _map(fd: int, length: int) -> mmap.mmap:
    return mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def create_segment(nbytes: int, kind: str = "tp") -> Segment:
    """Rank 0: a new segment of `nbytes` with a random name (naming `kind`: "tp", "link") and nonce. Its pages are
    reserved now (posix_fallocate): a full /dev/shm fails here with an OSError, not later with SIGBUS in the middle
    of a collective."""
    name = f"shardmesh-{kind}-{os.getpid()}-{secrets.token_hex(8)}"
    nonce = secrets.token_bytes(NONCE_BYTES)
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        mm = _map(fd, nbytes)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    mm[:NONCE_BYTES] = nonce
    return Segment(name, nonce, mm)


def attach_segment(name: str, nonce: bytes, nbytes: int) -> Segment:
    """Another rank: map the segment rank 0 announced and check its nonce (the file of that name in this rank's
    /dev/shm may be another one: another host's, or another container's). Raises OSError or ValueError."""
    fd = os.open(SHM_DIR / name, os.O_RDWR)
    try:
        found = os.fstat(fd).st_size
        if found != nbytes:
            raise ValueError(f"{SHM_DIR / name} holds {found} bytes, not {nbytes}")
        mm = _map(fd, found)
    finally:
        os.close(fd)
    if mm[:NONCE_BYTES] != nonce:
        mm.close()
        raise ValueError(f"{SHM_DIR / name} is not the segment rank 0 created (its nonce differs)")
    return Segment(name, nonce, mm)


def unlink_segment(name: str) -> None:
    (SHM_DIR / name).unlink(missing_ok=True)


class ShmCollective:
    """A `Collective` over a shared-memory segment every rank of the group has mapped (see the module docstring).

    `pids`: every rank's process id, by rank, whose liveness a waiting rank checks. `fallback`: the group's Gloo
    collective, for what the segment does not carry. Counts like `groups.GroupCollective`: `calls`, `bytes` (this
    rank's input) and `wait_s` (until the collective completed). After a failed collective the group is broken
    (ranks may be at different collectives) and every later call raises at once; the next topology forms anew.
    """

    transport = "shm"

    def __init__(self, segment: Segment, rank: int, size: int, pids: list[int], timeout: timedelta,
                 fallback: Fallback, capacity: int = DEFAULT_CAPACITY) -> None:  # fmt: skip
        if not 1 < size <= MAX_RANKS:
            raise ValueError(f"a shared-memory group has 2 to {MAX_RANKS} ranks, got {size}")
        ext = _KERNEL.module()
        if ext is None:
            raise RuntimeError(f"shared-memory collectives need their C++ kernel: {build_error()}")
        self._ext = ext
        self.segment, self.rank, self.size, self.capacity = segment, rank, size, capacity
        self.timeout_s = timeout.total_seconds()
        self.spin_s = spin_seconds(size)
        self.fallback = fallback
        self._seg = torch.frombuffer(segment.mm, dtype=torch.uint8)
        self._pids = torch.tensor(pids, dtype=torch.int64)
        self._offset = data_offset(size)
        self._seq = 0
        self._broken = ""
        self.calls = 0
        self.bytes = 0
        self.wait_s = 0.0

    def close(self, why: str) -> None:
        """Mark the group closed in the segment (every rank waiting in a collective reads it within a millisecond
        and raises, naming this rank) and close the Gloo group under it; this rank's later calls raise too."""
        self._broken = self._broken or f"rank {self.rank} closed the group: {why}"
        self._seg[CLOSED_AT : CLOSED_AT + 8].view(torch.int64).fill_(self.rank + 1)  # one aligned 8-byte store
        self.fallback.close(why)

    def describe(self) -> str:
        spin = f"spin {self.spin_s * 1e6:g} µs" if self.spin_s else "yields at once: more ranks than cores"
        return f"shm ({self.size} ranks, {self.capacity >> 10} KiB slots, {spin})"

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum over ranks, in place on `x.contiguous()` (returned), as `GroupCollective.all_reduce` does."""
        x = x.contiguous()
        t0 = time.perf_counter()
        code = SUPPORTED.get(x.dtype)
        if code is None:
            x = self.fallback.all_reduce(x)
        elif x.numel() * x.element_size() <= self.capacity:  # a decode step's: one slot, no chunking to set up
            self._run("all_reduce", self._ext.shm_all_reduce, x, code)
        else:
            flat = x.view(-1)
            step = self.capacity // x.element_size()
            for start in range(0, flat.numel(), step):
                self._run("all_reduce", self._ext.shm_all_reduce, flat[start : start + step], code)
        self._count(x, t0)
        return x

    def all_reduce_add(self, partial: Tensor, x: Tensor) -> Tensor:
        """x + all_reduce(partial), rounded as those two ops round, written over `partial` (returned) in one call of
        the kernel when both are contiguous host tensors of one size and a dtype it sums; else the two ops."""
        t0 = time.perf_counter()
        if not self._run("all_reduce", self._ext.shm_all_reduce_add, partial, x):
            return x + self.all_reduce(partial)
        self._count(partial, t0)
        return partial

    def native_all_reduce_add(self, x: Tensor) -> tuple[Any, ...] | None:
        """What a C++ caller passes to `shm_all_reduce_add` after its two tensors, each like `x`, led by the
        kernel's address: its own collectives number on from the group's (the arguments' sequence number, then one
        more each). Then `reduced_natively` with how many it made. None when tensors like `x` do not go through the
        segment in one collective (another dtype, more than a slot): the caller reduces through `all_reduce_add`.
        Raises as a collective would on a group that broke earlier."""
        self._check_unbroken("all_reduce")
        if x.dtype not in SUPPORTED or x.device.type != "cpu" or x.numel() * x.element_size() > self.capacity:
            return None
        return (self._ext.shm_all_reduce_add_address(), self._seg, self.rank, self.size, self._seq, self.capacity,
                self._offset, self._pids, self.spin_s, self.timeout_s)  # fmt: skip

    def reduced_natively(self, done: int, status: int, nbytes: int, waited: float) -> None:
        """After a C++ caller made `done` collectives with `native_all_reduce_add`'s arguments, of `nbytes` each, in
        `waited` seconds, the last returning `status`: the group's sequence and counters move on, and a failure
        raises (and breaks the group) as `all_reduce_add` would."""
        self._seq += done
        self.calls += done
        self.bytes += done * nbytes
        self.wait_s += waited
        if status != 0:
            self._fail("all_reduce", status, waited)

    def all_gather(self, x: Tensor) -> Tensor:
        """Every rank's `x` concatenated along the last dim (all ranks pass the same shape)."""
        x = x.contiguous()
        t0 = time.perf_counter()
        width = x.shape[-1] if x.dim() else 1
        row_bytes = width * x.element_size()
        if x.dtype not in SUPPORTED or row_bytes > self.capacity or x.dim() == 0:
            out = self.fallback.all_gather(x)
        else:
            rows = x.reshape(-1, width)
            gathered = torch.empty(rows.shape[0], self.size * width, dtype=x.dtype)
            step = self.capacity // row_bytes
            for start in range(0, max(rows.shape[0], 1), step):
                self._run("all_gather", self._ext.shm_all_gather, rows[start : start + step],
                          gathered[start : start + step])  # fmt: skip
            out = gathered.view(*x.shape[:-1], self.size * width)
        self._count(x, t0)
        return out

    def _run(self, what: str, fn: Any, *args: Any) -> bool:
        """One collective through the segment; a failure names the peer, and breaks the group. False when the kernel
        refused the tensors before this rank published anything (NOT_CARRIED): the sequence number stays unused."""
        self._check_unbroken(what)
        self._seq += 1
        t0 = time.perf_counter()
        status = fn(self._seg, *args, self.rank, self.size, self._seq, self.capacity, self._offset, self._pids,
                    self.spin_s, self.timeout_s)  # fmt: skip
        if status == NOT_CARRIED:
            self._seq -= 1
            return False
        if status != 0:
            self._fail(what, status, time.perf_counter() - t0)
        return True

    def _check_unbroken(self, what: str) -> None:
        """Raise, naming why, once a collective of this group has failed or the group was closed."""
        if self._broken:
            raise RuntimeError(f"tensor-parallel {what} over shm: the group broke earlier ({self._broken})")

    def _fail(self, what: str, status: int, waited: float) -> NoReturn:
        """Name the peer a collective failed on (the kernel's `status`) after `waited` seconds, and break the
        group."""
        peer = status - CLOSED if status >= CLOSED else abs(status) - 1
        if status >= CLOSED:
            why = (f"rank {peer} (pid {int(self._pids[peer])}) closed the group (its epoch broke) while rank "
                   f"{self.rank} waited {waited:.3f} s")  # fmt: skip
        elif status > 0:
            why = f"rank {peer} (pid {int(self._pids[peer])}) died while rank {self.rank} waited {waited:.3f} s"
        else:
            why = (f"rank {peer} (pid {int(self._pids[peer])}) did not arrive within the group timeout of "
                   f"{self.timeout_s:g} s (--group-timeout); rank {self.rank} waited {waited:.3f} s")  # fmt: skip
        self._broken = why
        raise RuntimeError(f"tensor-parallel {what} #{self._seq} over shm: {why}")

    def _count(self, x: Tensor, t0: float) -> None:
        self.wait_s += time.perf_counter() - t0
        self.calls += 1
        self.bytes += x.nbytes


def pid_namespace() -> str:
    """This process's pid namespace ("" if unknown): peers' liveness can be checked only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def check_transport(wanted: str, variable: str = TRANSPORT_ENV) -> str:
    """`wanted` when it is one of TRANSPORTS, else a ValueError naming `variable` (this module's, or the pipeline
    links' `shm_link.TRANSPORT_ENV`) and the choices."""
    if wanted not in TRANSPORTS:
        raise ValueError(f"{variable}={wanted!r} is not one of {', '.join(TRANSPORTS)}")
    return wanted


def transport_from_env(variable: str = TRANSPORT_ENV) -> str:
    """The transport asked for in $`variable` ("auto" when unset or empty, case aside), checked (`check_transport`):
    this module's for tp groups, `shm_link.TRANSPORT_ENV` for pipeline links."""
    return check_transport(os.environ.get(variable, "auto").strip().lower() or "auto", variable)


def negotiate(store: dist.Store, prefix: str, rank: int, size: int, timeout: timedelta, fallback: Fallback,
              wanted: str = "auto", capacity: int = DEFAULT_CAPACITY) -> tuple[ShmCollective | None, str]:  # fmt: skip
    """Whether every rank of a group can use a shared segment (`agree`): a ShmCollective when they can, else None
    and the first reason. `wanted` "gloo" makes this rank refuse (and so every rank)."""
    check_transport(wanted)
    # Built before any wait: ranks on one host build it together (one waits on the other's lock).
    refusal = f"{TRANSPORT_ENV}=gloo" if wanted == "gloo" else _unbuilt()
    segment, pids, reason = agree(store, prefix, rank, size, timeout, refusal, segment_bytes(size, capacity), "tp")
    if segment is None:
        return None, reason
    return ShmCollective(segment, rank, size, pids, timeout, fallback, capacity), ""


def agree(store: dist.Store, prefix: str, rank: int, size: int, timeout: timedelta, refusal: str, nbytes: int,
          kind: str) -> tuple[Segment | None, list[int], str]:  # fmt: skip
    """Whether every rank of a group (a tp group, or a link's two sides) can map one segment of `nbytes`, agreed
    through `store` under `prefix`.

    Rank 0 creates a segment and announces its name and nonce; every other rank maps it and checks the nonce
    (which proves the same host and the same /dev/shm); every rank reports whether it could, with its pid and pid
    namespace; rank 0 then unlinks the file. All ranks read the same reports and so reach the same answer: the
    segment and every rank's pid when every rank succeeded and all share a pid namespace, else None and the first
    reason. A non-empty `refusal` (the caller's: its variable says gloo, its kernel is not built) makes this rank
    refuse (and so every rank); so does a host without SHM_DIR. Raises RuntimeError when a rank never reports
    within `timeout`."""
    refusal = refusal or (f"no {SHM_DIR}" if not SHM_DIR.is_dir() else "")
    segment: Segment | None = None
    created = ""
    what = f"shared-memory {kind} {prefix}"
    try:
        if rank == 0:
            offer: dict[str, Any] = {"name": "", "nonce": "", "reason": refusal}
            if not refusal:
                try:
                    segment = create_segment(nbytes, kind)
                    created = segment.name
                    offer.update(name=segment.name, nonce=segment.nonce.hex())
                except OSError as e:
                    refusal = offer["reason"] = f"cannot create a segment in {SHM_DIR}: {e}"
            store.set(f"{prefix}/offer", json.dumps(offer))
        else:
            offer = json.loads(_wait_get(store, f"{prefix}/offer", timeout, what, "rank 0"))
            if not refusal and offer["name"]:
                try:
                    segment = attach_segment(offer["name"], bytes.fromhex(offer["nonce"]), nbytes)
                except (OSError, ValueError) as e:
                    refusal = f"cannot map rank 0's segment: {e}"
            elif not refusal:
                refusal = f"rank 0 offered none ({offer['reason']})"
        mine = {"reason": refusal, "pid": os.getpid(), "pidns": pid_namespace()}
        store.set(f"{prefix}/rank/{rank}", json.dumps(mine))
        reports = [json.loads(_wait_get(store, f"{prefix}/rank/{r}", timeout, what, f"rank {r}"))
                   for r in range(size)]  # fmt: skip
    except BaseException:
        if segment is not None:
            segment.close()
        raise
    finally:
        if created:  # every rank has reported (or will never): none maps it any more
            unlink_segment(created)
    reason = _verdict(reports)
    if reason:
        if segment is not None:
            segment.close()
        return None, [], reason
    assert segment is not None
    return segment, [int(r["pid"]) for r in reports], ""


def _unbuilt() -> str:
    """Why this rank has no collective kernel, or ""."""
    return "" if available() else f"no C++ build of the shm kernel ({build_error()})"


def _verdict(reports: list[dict[str, Any]]) -> str:
    """The first reason a group cannot use shm, from every rank's report (the same on every rank), or ""."""
    for r, report in enumerate(reports):
        if report["reason"]:
            return f"rank {r}: {report['reason']}"
    namespaces = {report["pidns"] for report in reports}
    if len(namespaces) > 1 or "" in namespaces:
        return "the ranks do not share one known pid namespace, so they cannot watch each other's liveness"
    return ""


def _wait_get(store: dist.Store, key: str, timeout: timedelta, what: str, who: str) -> str:
    try:
        store.wait([key], timeout)
        return store.get(key).decode()
    except RuntimeError:  # DistStoreError: that rank never came (or the store is gone)
        raise RuntimeError(f"{what}: {who} did not report within {timeout.total_seconds():g} s "
                           f"(--group-timeout)") from None  # fmt: skip
