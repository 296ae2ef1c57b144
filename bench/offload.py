"""Offload speed: a shard with a memory budget of half its weights against the resident shard, hot and cold.

    .venv/bin/python bench/offload.py [--model smollm2-135m-instruct] [--threads 1] [--steps 40] [--rounds 3]
                                      [--cold-steps 6]

Writes bench/results/<host>-<date>-offload.{md,json} and prints the markdown. Everything runs in one process, on a
private copy of the checkpoint (dropping its pages for the cold steps leaves the page cache of the original, which
other processes may be timing, alone). One shard holds the whole model (pp=1, tp=1), driven as bench/int8.py
drives it (`Streams`: the chat prompt prefilled, then greedy decode steps of one sequence).

- Hot: the resident shard and the streamed variants step alternately, one step each, `--steps` timed steps per
  round after one warm-up step, `--rounds` rounds; every number is the median of the rounds' medians, every ratio
  a variant's ms per step over the resident shard's in the same rounds. Variants, all with the same budget:
  `streamed` as `build_shard` chooses it at load (huge-page mappings where the page cache holds the file in huge
  folios; each layer mapped on the compute thread while reads find it in the page cache, prefetched by the reader
  thread while they do not), `reader thread` (the same mappings always prefetched one layer ahead by the reader
  thread, the previous design), `mapped inline` (always mapped on the compute thread) and `4 KiB entries` (the
  mappings advised MADV_NOHUGEPAGE, so each layer maps and unmaps 4 KiB at a time, prefetched by the reader
  thread: the page-table cost before).
  Every streamed step must count exactly the plan's bytes (`shardmesh_offload_streamed_bytes_total`).
  With `--int8`, two more in the same rounds: `int8 resident` (`--quantize int8`) and `int8 streamed` (int8 with a
  budget of the int8 shard's weights less half its layers' int8 products, which then map from the int8 copy written
  at load into a private cache), each also over `int8 resident`.
- Disk bound: O_DIRECT reads, 8 MiB each, of the streamed layers' byte ranges of the file (merged, in file order),
  one in flight and four in flight, before and after the cold steps; the bound is the fastest of the four.
- Cold: before each step the file's pages are dropped (`posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`), so the
  step reads its streamed layers from the disk; `streamed`, `reader thread` and `mapped inline` take turns step by
  step, which of them reads first rotating (a virtual disk may serve blocks read a moment ago faster). Achieved
  rate = the plan's streamed bytes per step / the step's whole time (resident layers and head included, so a
  lower bound on the streaming rate), over the disk bound.

Also recorded: the plan, whether the layers map in huge pages, the bound the streamer measured at load, the CPU
model and flags, and the disk (its model where the kernel knows it, rotational, read_ahead_kb).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import PROMPT, machine, save_results  # noqa: E402  (the repository root is on the path only now)
from bench.int8 import Streams  # noqa: E402

CHUNK = 8 * 2**20  # bytes per O_DIRECT read
DEPTHS = (1, 4)  # O_DIRECT reads in flight: one after the other, and as a deep readahead keeps the disk busy
MADV_NOHUGEPAGE = 15
VARIANTS = ("streamed", "reader thread", "4 KiB entries", "mapped inline")
INT8_VARIANTS = ("int8 resident", "int8 streamed")
COLD_VARIANTS = ("streamed", "reader thread", "mapped inline")


def disk_of(path: Path) -> dict[str, Any]:
    """The block device holding `path`: its name, model (where the kernel knows it), rotational, read_ahead_kb."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
    if not (dev / "queue").exists():  # a partition: the queue is its disk's
        dev = dev.parent

    def read(rel: str) -> str:
        try:
            return (dev / rel).read_text().strip()
        except OSError:
            return ""

    return {"device": dev.name, "model": read("device/model") or read("device/vendor") or "(not reported)",
            "rotational": read("queue/rotational") == "1", "read_ahead_kb": int(read("queue/read_ahead_kb") or 0),
            "size_gib": round(int(read("size") or 0) * 512 / 2**30, 1)}  # fmt: skip


def streamed_spans(streamer: Any) -> list[tuple[int, int]]:
    """The streamed layers' [begin, end) byte ranges of the file, merged, 4 KiB-aligned (O_DIRECT's unit)."""
    from shardmesh.engine.offload import _align, _merge

    return _merge([_align(o, o + n, 4096) for layer in streamer.layers.values() for _, o, n in layer.files])


def disk_bound(path: Path, spans: list[tuple[int, int]], depth: int) -> float:
    """Bytes per second of O_DIRECT reads of `spans` in file order (no page cache), `depth` reads in flight (one
    thread each, taking the next `CHUNK` in turn)."""
    from concurrent.futures import ThreadPoolExecutor

    chunks = [(at, min(CHUNK, end - at)) for begin, end in spans for at in range(begin, end, CHUNK)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffers = [mmap.mmap(-1, CHUNK) for _ in range(depth)]  # page-aligned, as O_DIRECT requires

    def read(worker: int) -> int:
        return sum(os.preadv(fd, [memoryview(buffers[worker])[:n]], at) for at, n in chunks[worker::depth])

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(depth) as pool:
            total = sum(pool.map(read, range(depth)))
    finally:
        os.close(fd)
        for b in buffers:
            b.close()
    return total / (time.perf_counter() - t0)


def drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load(model_dir: Path, max_len: int, int8: bool = False) -> tuple[dict[str, Any], int]:
    """{"resident": model, variant: model}, each one shard of the whole model, and the budget (half the resident
    shard's parameter bytes) the variants were built with; with `int8` the int8 shard and the int8 shard under half
    its own weights' bytes too."""
    import torch

    from shardmesh.core.config import ModelConfig
    from shardmesh.core.dtypes import Quantization
    from shardmesh.core.layout import ShardSpec
    from shardmesh.engine.groups import SingleRank
    from shardmesh.engine.loader import build_shard
    from shardmesh.engine.offload import _madvise

    cfg = ModelConfig.from_dir(model_dir)
    spec = ShardSpec(0, cfg.num_layers, cfg.num_layers)
    kw: dict[str, Any] = {"dtype": torch.float32, "max_len": max_len, "progress": False, "cfg": cfg}
    models = {"resident": build_shard(model_dir, spec, SingleRank(), **kw)}
    budget = sum(p.numel() * p.element_size() for p in models["resident"].parameters()) // 2
    for name in VARIANTS:
        models[name] = build_shard(model_dir, spec, SingleRank(), memory_budget=budget, **kw)
    models["reader thread"].streamer.inline = False
    models["mapped inline"].streamer.bound_bytes_per_second = 0.0  # never cold: maps inline even from the disk
    small = models["4 KiB entries"].streamer
    small.inline = False
    _madvise([(addr, len(mm)) for mm, addr in small._maps.values()], MADV_NOHUGEPAGE)
    if int8:
        q = Quantization.INT8
        models["int8 resident"] = build_shard(model_dir, spec, SingleRank(), quantization=q, **kw)
        tensors = dict(models["int8 resident"].named_parameters())
        tensors |= {n: b for n, b in models["int8 resident"].named_buffers() if n.endswith("weight_scale")}
        held = sum(t.numel() * t.element_size() for t in tensors.values())
        layers = sum(t.numel() * t.element_size() for n, t in tensors.items()
                     if n.startswith("model.layers.") and t.dtype in (torch.int8, torch.float16))  # fmt: skip
        models["int8 streamed"] = build_shard(model_dir, spec, SingleRank(), quantization=q,
                                              memory_budget=held - layers // 2, **kw)  # fmt: skip
    return models, budget


def hot_round(models: dict[str, Any], prompt_ids: list[int], steps: int) -> dict[str, float]:
    """Median ms per decode step of each model, their steps interleaved one by one; checks each streamed step
    counted exactly the plan's bytes."""
    import torch

    streams = {name: Streams(m, 1, prompt_ids) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in streams}
    with torch.inference_mode():
        for i in range(steps + 1):  # the first step of each warms caches: not counted
            for name, s in streams.items():
                streamer = models[name].streamer
                before = streamer.bytes_streamed if streamer is not None else 0
                t0 = time.perf_counter()
                s.step()
                if i:
                    times[name].append((time.perf_counter() - t0) * 1e3)
                if streamer is not None:
                    got = streamer.bytes_streamed - before
                    assert got == streamer.plan.streamed_bytes_per_step, (name, got, streamer.plan)
    return {name: statistics.median(t) for name, t in times.items()}


def cold_steps(models: dict[str, Any], prompt_ids: list[int], steps: int, path: Path) -> dict[str, dict[str, Any]]:
    """Per cold variant: each step's ms and the reads' and waits' seconds, the file's pages dropped before it."""
    import torch

    names = COLD_VARIANTS
    streams = {name: Streams(models[name], 1, prompt_ids) for name in names}
    out: dict[str, dict[str, Any]] = {name: {"ms": [], "read_s": [], "wait_s": []} for name in names}
    with torch.inference_mode():
        for k in range(steps):
            for name in names[k % len(names) :] + names[: k % len(names)]:  # who reads first after the drop rotates
                s, streamer = streams[name], models[name].streamer
                read, wait = streamer.read_seconds, streamer.wait_seconds
                drop_pages(path)
                t0 = time.perf_counter()
                s.step()
                out[name]["ms"].append((time.perf_counter() - t0) * 1e3)
                out[name]["read_s"].append(streamer.read_seconds - read)
                out[name]["wait_s"].append(streamer.wait_seconds - wait)
    return out


def report(info: dict, a: argparse.Namespace, data: dict[str, Any], out: Path) -> None:
    plan, gb = data["plan"], 1e9
    hot, cold, bound = data["hot"], data["cold"], data["disk_bound_bytes_per_s"]
    lines = [
        f"## Offload — {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {info['date']}",
        "",
        f"Model `{a.model}` float32, one shard of the whole model, a memory budget of half its weights "
        f"({data['budget'] / 2**20:.1f} MiB): {plan['describe']}. Huge-page mappings: {data['huge_pages']}; "
        f"layers mapped on the compute thread: {data['inline']}; the read rate measured at load (page cache): "
        f"{data['load_bound_bytes_per_s'] / gb:.1f} GB/s. {a.threads} thread(s); greedy decode of one sequence "
        f"after the chat prompt of {PROMPT!r} ({data['prompt_tokens']} tokens). "
        f"CPU: {info['cpu_id']}; flags: {' '.join(info['cpu_flags'])}. "
        "Disk: " + ", ".join(f"{k} {v}" for k, v in data["disk"].items()) + ". The machine was shared: compare "
        "ratios measured side by side, not absolute times.",
        "",
        f"### Hot page cache: median ms per step over {a.steps} steps × {a.rounds} rounds (median of the rounds' "
        "medians), steps interleaved",
        "",
        "| variant | ms / step | × resident | range over rounds |",
        "|---|---:|---:|---|",
    ]  # fmt: skip
    for name in ("resident", *VARIANTS):
        h = hot[name]
        lines.append(f"| {name} | {h['ms']:.2f} | **{h['ratio']:.2f}×** | {h['ratio_range'][0]:.2f}–"
                     f"{h['ratio_range'][1]:.2f} |")  # fmt: skip
    if "int8 streamed" in hot:
        i8, s8 = hot["int8 resident"], hot["int8 streamed"]
        lines += [
            "",
            f"int8 (`--quantize int8`), same rounds: {data['int8_plan']}",
            "",
            "| variant | ms / step | × float32 resident | × int8 resident | range over rounds (× int8 resident) |",
            "|---|---:|---:|---:|---|",
            f"| int8 resident | {i8['ms']:.2f} | {i8['ratio']:.2f}× | 1.00× | |",
            f"| int8 streamed | {s8['ms']:.2f} | {s8['ratio']:.2f}× | **{s8['of_int8']:.2f}×** | "
            f"{s8['of_int8_range'][0]:.2f}–{s8['of_int8_range'][1]:.2f} |",
        ]  # fmt: skip
    lines += [
        "",
        f"Bytes streamed per step: {plan['streamed_bytes_per_step']} B, exactly the plan's in every step "
        "(checked per step).",
        "",
        f"### Cold: the file's pages dropped before each of {a.cold_steps} steps",
        "",
        f"Disk bound: {bound / gb:.2f} GB/s, the fastest O_DIRECT read of the streamed ranges in file order "
        f"({CHUNK // 2**20} MiB reads; GB/s before and after the cold steps: "
        + ", ".join(f"{k} in flight {v[0] / gb:.2f} and {v[1] / gb:.2f}" for k, v in data["disk_bound_runs"].items())
        + ").",
        "",
        "| variant | ms / step (median) | streamed GB/s | × disk bound | reads' s / step | compute thread waited "
        "s / step |",
        "|---|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for name, c in cold.items():
        lines.append(f"| {name} | {c['ms']:.1f} | {c['gb_s']:.2f} | **{c['of_bound']:.2f}×** | {c['read_s']:.3f} | "
                     f"{c['wait_s']:.3f} |")  # fmt: skip
    save_results(out, info, "-offload", "\n".join(lines) + "\n", data)


def main() -> None:
    import torch

    from shardmesh.engine.offload import map_unit
    from shardmesh.models.registry import known_models, resolve
    from shardmesh.models.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", choices=known_models())
    ap.add_argument("--threads", type=int, default=1, help="torch threads (one is steadier on a shared machine)")
    ap.add_argument("--steps", type=int, default=40, help="timed hot decode steps per variant, per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold-steps", type=int, default=6)
    ap.add_argument("--int8", action="store_true", help="also int8 resident and int8 streamed (hot rounds)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    source = resolve(a.model)
    prompt_ids = Tokenizer.from_dir(source).encode_chat([{"role": "user", "content": PROMPT}])
    info = machine()  # CPU model, id and flags included
    with tempfile.TemporaryDirectory(dir=source.parent, prefix=".offload-bench-") as tmp:
        model_dir = Path(shutil.copytree(source, Path(tmp) / source.name))
        path = model_dir / "model.safetensors"
        with path.open("rb") as f:  # written back, so its pages are clean: the page cache can drop them
            os.fsync(f.fileno())
        max_len = len(prompt_ids) + a.rounds * (a.steps + 1) + a.cold_steps + 2
        os.environ["SHARDMESH_CACHE"] = str(Path(tmp) / "cache")  # the int8 copy of this private checkpoint's layers
        models, budget = load(model_dir, max_len, a.int8)
        streamer = models["streamed"].streamer
        spans = streamed_spans(streamer)
        rounds = [hot_round(models, prompt_ids, a.steps) for _ in range(a.rounds)]
        print(f"hot rounds: {rounds}", file=sys.stderr)
        bounds = {f"depth {d}": [disk_bound(path, spans, d)] for d in DEPTHS}
        cold = cold_steps(models, prompt_ids, a.cold_steps, path)
        for d in DEPTHS:
            bounds[f"depth {d}"].append(disk_bound(path, spans, d))
        disk = disk_of(path)
    bound, per_step = max(max(b) for b in bounds.values()), streamer.plan.streamed_bytes_per_step
    hot = {}
    for name in ("resident", *VARIANTS, *(INT8_VARIANTS if a.int8 else ())):
        ratios = [r[name] / r["resident"] for r in rounds]
        hot[name] = {"ms": statistics.median(r[name] for r in rounds), "ratio": statistics.median(ratios),
                     "ratio_range": [min(ratios), max(ratios)], "rounds_ms": [r[name] for r in rounds]}  # fmt: skip
    if a.int8:
        of_int8 = [r["int8 streamed"] / r["int8 resident"] for r in rounds]
        hot["int8 streamed"] |= {"of_int8": statistics.median(of_int8), "of_int8_range": [min(of_int8), max(of_int8)]}
    cold_summary = {}
    for name, c in cold.items():
        ms = statistics.median(c["ms"])
        cold_summary[name] = {"ms": ms, "gb_s": per_step / ms / 1e6, "of_bound": per_step / (ms / 1e3) / bound,
                              "read_s": statistics.median(c["read_s"]), "wait_s": statistics.median(c["wait_s"]),
                              "steps": c}  # fmt: skip
    plan = streamer.plan
    data = {
        "model": a.model, "threads": a.threads, "budget": budget, "prompt_tokens": len(prompt_ids),
        "plan": {"describe": plan.describe(),
                 "resident_layers": [plan.resident_layers.start, plan.resident_layers.stop],
                 "streamed_layers": [plan.streamed_layers.start, plan.streamed_layers.stop],
                 "streamed_bytes_per_step": per_step, "working_set_bytes": plan.working_set_bytes,
                 "map_unit": plan.map_unit, "host_map_unit": map_unit()},
        "huge_pages": streamer.huge_pages, "inline": streamer.inline,
        "load_bound_bytes_per_s": streamer.bound_bytes_per_second, "disk": disk,
        "disk_bound_bytes_per_s": bound, "disk_bound_runs": bounds, "hot": hot, "hot_rounds": rounds,
        "cold": cold_summary,
        "int8_plan": models["int8 streamed"].streamer.plan.describe() if a.int8 else None,
    }  # fmt: skip
    report(info, a, data, Path(a.out))


if __name__ == "__main__":
    main()
