"""Which device each rank of a mesh computes on: `--device` turned into one device string per global rank.

Every rank gets an explicit `cuda:N` with all GPUs visible (as torchrun's LOCAL_RANK does), rather than a
`CUDA_VISIBLE_DEVICES` of its own: the device then shows in each worker's command line, its log lines and its
registration, and equals the plan's device index. NCCL refuses two ranks on one GPU, so does this module, before
any process starts. Global rank = stage * tp + tp_rank.

Grammar of a spec (`--device`, `services.worker.device`):

  ``cpu``            every rank on the CPU
  ``cuda``           rank r on ``cuda:r``
  ``cuda:N``         one rank only, on GPU N
  ``A,B,...``        one entry per stage (each applies to all tp ranks of that stage) or one per rank; an entry
                     is ``cpu``, ``cuda`` (the next GPU index not named explicitly anywhere, in rank order) or
                     ``cuda:N``

Pure: no torch at module level. The caller passes the visible GPU count (`visible_gpu_count`).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence

_CUDA_INDEX = re.compile(r"cuda:(\d+)")
VISIBLE_HINT = "CUDA_VISIBLE_DEVICES, when set, limits which GPUs a process sees"


def cores() -> int:
    """The CPU cores this process may run on (its affinity, where the OS reports one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def visible_gpu_count() -> int:
    """GPUs this process sees: `torch.cuda.device_count()`, 0 without CUDA (torch is imported only here)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(spec: str) -> bool:
    """Whether `spec` names a GPU anywhere: only then is the (slow, torch-importing) GPU count worth asking."""
    return "cuda" in spec


def visible_gpus_for(spec: str) -> int:
    """The GPUs this process sees, asked of torch only when `spec` names one (0 otherwise: a CPU mesh's flags are
    checked without importing torch)."""
    return visible_gpu_count() if needs_gpus(spec) else 0


def rank_devices(spec: str, pp: int, tp: int) -> list[str]:
    """Each rank's `--device` for ranks all on this host (`assign_devices` against the GPUs this process sees; with
    cuda, rank r on cuda:r, one GPU each). Raises ValueError naming `--device` and the counts, before any process
    starts; imports torch only when `spec` names a GPU."""
    return assign_devices(spec, pp, tp, visible_gpus_for(spec))


def _ranks(world: int, pp: int, tp: int) -> str:
    return f"{world} rank{'s' if world != 1 else ''} (pp={pp} × tp={tp})"


def _gpus(n: int) -> str:
    return f"{n} GPU{'s' if n != 1 else ''}"


def _are_visible(n: int) -> str:
    return f"{n} {'is' if n == 1 else 'are'} visible"


def _gpus_visible(n: int) -> str:
    return f"{_gpus(n)} {'is' if n == 1 else 'are'} visible"


def _index(entry: str) -> int | None:
    """N of ``cuda:N``; None for ``cpu`` and ``cuda``; ValueError for anything else (the caller names it)."""
    if entry in ("cpu", "cuda"):
        return None
    m = _CUDA_INDEX.fullmatch(entry)
    if m is None:
        raise ValueError(entry)
    return int(m.group(1))


def _check_index(flag: str, spec: str, index: int, visible_gpus: int | None, rank: int | None = None) -> None:
    if visible_gpus is not None and index >= visible_gpus:
        what = f"cuda:{index} (rank {rank})" if rank is not None else f"GPU {index}"
        seen = f"cuda:0..cuda:{visible_gpus - 1}" if visible_gpus else "no CUDA device"
        raise ValueError(f"{flag} {spec}: {what} does not exist: {_gpus_visible(visible_gpus)} "
                         f"({seen}; {VISIBLE_HINT})")  # fmt: skip


def assign_devices(spec: str, pp: int, tp: int, visible_gpus: int | None, flag: str = "--device") -> list[str]:
    """One device string per global rank ("cpu" or "cuda:N"), each GPU used by one rank at most.

    Raises ValueError naming `flag` and the counts: more ranks than GPUs, `cuda:N` for several ranks, an index
    that is not visible, two ranks on one GPU, a stage whose tensor-parallel ranks mix cpu and cuda.
    `visible_gpus` None: the GPUs are on hosts of their own (a manifest's commands), so whether they exist is not
    checked here; everything else is."""
    if pp < 1 or tp < 1:
        raise ValueError(f"pp and tp must be >= 1, got pp={pp}, tp={tp}")
    entries = [e.strip() for e in spec.strip().split(",")]
    if len(entries) == 1:
        return _one_for_all(flag, entries[0], pp, tp, visible_gpus)
    return _listed(flag, spec.strip(), entries, pp, tp, visible_gpus)


def _one_for_all(flag: str, entry: str, pp: int, tp: int, visible_gpus: int | None) -> list[str]:
    world = pp * tp
    try:
        index = _index(entry)
    except ValueError:
        raise ValueError(f"{flag}: expected cpu, cuda, cuda:N or a comma-separated list of them (one per stage or "
                         f"one per rank), got {entry!r}") from None  # fmt: skip
    if entry == "cpu":
        return ["cpu"] * world
    if entry == "cuda":
        if visible_gpus is not None and world > visible_gpus:
            raise ValueError(f"{flag} cuda: {_ranks(world, pp, tp)} need {_gpus(world)}, one each, but "
                             f"{_are_visible(visible_gpus)} ({VISIBLE_HINT})")  # fmt: skip
        return [f"cuda:{r}" for r in range(world)]
    assert index is not None
    if world > 1:
        raise ValueError(f"{flag} {entry}: {world} ranks cannot share one GPU (NCCL refuses two ranks on one GPU); "
                         f"give {flag} cuda for one GPU per rank, or a list")  # fmt: skip
    _check_index(flag, entry, index, visible_gpus)
    return [entry]


def _per_rank_entries(flag: str, spec: str, entries: Sequence[str], pp: int, tp: int) -> list[str]:
    """The list expanded to one entry per rank: a per-stage entry repeats for the stage's tp ranks."""
    world = pp * tp
    if len(entries) == world:
        return list(entries)
    if len(entries) != pp:
        lengths = f"{world}, one per rank" if pp == world else f"{pp}, one per stage, or {world}, one per rank"
        raise ValueError(f"{flag} {spec}: {len(entries)} entries for pp={pp} × tp={tp}; give {lengths}")
    for stage, entry in enumerate(entries):
        if tp > 1 and _CUDA_INDEX.fullmatch(entry):
            raise ValueError(f"{flag} {spec}: stage {stage} on {entry}: its {tp} tensor-parallel ranks cannot share "
                             "one GPU; give cuda (a GPU each) or one entry per rank")  # fmt: skip
    return [entry for entry in entries for _ in range(tp)]


def _listed(flag: str, spec: str, entries: Sequence[str], pp: int, tp: int, visible_gpus: int | None) -> list[str]:
    per_rank = _per_rank_entries(flag, spec, entries, pp, tp)
    indices: list[int | None] = []
    for rank, entry in enumerate(per_rank):
        try:
            indices.append(_index(entry))
        except ValueError:
            raise ValueError(f"{flag} {spec}: {entry!r} (rank {rank}) is not cpu, cuda or cuda:N") from None
    owner: dict[int, int] = {}  # GPU index -> the rank named on it
    for rank, index in enumerate(indices):
        if index is None:
            continue
        _check_index(flag, spec, index, visible_gpus, rank)
        if index in owner:
            raise ValueError(f"{flag} {spec}: ranks {owner[index]} and {rank} both on cuda:{index} (NCCL refuses "
                             "two ranks on one GPU)")  # fmt: skip
        owner[index] = rank
    # Plain `cuda`: the GPUs no entry names, lowest first, in rank order.
    indices_seen = range(visible_gpus) if visible_gpus is not None else itertools.count()
    free = iter(i for i in indices_seen if i not in owner)
    plain = sum(e == "cuda" for e in per_rank)
    out: list[str] = []
    for entry, index in zip(per_rank, indices, strict=True):
        if entry == "cuda":
            index = next(free, None)
            if index is None:
                named = f" besides the {len(owner)} named" if owner else ""
                raise ValueError(f"{flag} {spec}: {plain} rank{'s' if plain != 1 else ''} on plain cuda need "
                                 f"{_gpus(plain)}{named}, but {_are_visible(visible_gpus)} "
                                 f"({VISIBLE_HINT})")  # fmt: skip
        out.append("cpu" if entry == "cpu" else f"cuda:{index}")
    _check_stages(flag, spec, out, pp, tp)
    return out


def _check_stages(flag: str, spec: str, devices: Sequence[str], pp: int, tp: int) -> None:
    """A stage's tensor-parallel ranks run one collective group, on one backend (Gloo or NCCL)."""
    for stage in range(pp):
        ranks = devices[stage * tp : (stage + 1) * tp]
        if len({d.partition(":")[0] for d in ranks}) > 1:
            raise ValueError(f"{flag} {spec}: stage {stage}: its tensor-parallel ranks must share a device type, got "
                             f"{', '.join(ranks)}")  # fmt: skip


def spare_devices(devices: Sequence[str], spares: int, visible_gpus: int, flag: str = "--device") -> list[str]:
    """The devices of `spares` workers beyond the ranks' `devices`: cpu when every rank is on the CPU, else each
    spare on a GPU no rank (nor an earlier spare) uses. A spare takes over a rank's slot, so it needs a device of
    its own. Raises ValueError with the counts when the GPUs run out."""
    if all(d == "cpu" for d in devices):
        return ["cpu"] * spares
    used = {int(d.partition(":")[2]) for d in devices if d != "cpu"}
    free = [i for i in range(visible_gpus) if i not in used]
    if spares > len(free):
        raise ValueError(f"--spares {spares}: each spare needs a GPU of its own, but the {len(devices)} ranks "
                         f"({flag}) use {len(used)} of the {visible_gpus} visible GPUs, leaving {len(free)} "
                         f"({VISIBLE_HINT})")  # fmt: skip
    return [f"cuda:{i}" for i in free[:spares]]


def check_worker_device(spec: str, visible_gpus: int | None) -> str:
    """One worker process's `--device`, as it will use it: "cpu" or "cuda:N". Plain `cuda` is `cuda:0` (a worker
    alone in a container that sees one GPU; `up` and the manifest's commands always give an index). Raises
    ValueError naming `--device`, the index and the GPU count; `visible_gpus` None checks the spelling only (a
    config read on another machine than the one that runs it)."""
    entry = spec.strip()
    try:
        index = _index(entry)
    except ValueError:
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {spec!r}") from None
    if entry == "cpu":
        return "cpu"
    index = 0 if index is None else index
    _check_index("--device", entry, index, visible_gpus)
    return f"cuda:{index}"
