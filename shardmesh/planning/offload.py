"""Offload in the planner: which layers of a shard stay resident under a memory budget, the bytes streamed per
step, the host memory the streamed weights need and the step time they predict. Pure: numbers in, numbers out.

It counts what `shardmesh.engine.offload.plan_offload` counts (that module's docstring), from config.json alone.
Per shard of n layers on rank r of tp, serving dtype b bytes, checkpoint dtype c bytes, budget B (weights only):

  products    = P × b, P = elements of one layer's four products on this rank (`weights.Part.products`)
  resident(k) = the shard's weights with every layer loaded (`memory.shard_memory(...).weights`) − (n − k) × products
  working(m)  = the streamed weights in the worker at once, m = n − k layers streaming:
                zero-copy (cpu, c = b): min(2, m) × Σ over the layer's product reads of `mapped_bound(span × c, u)`,
                  the pages each read maps rounded out to u on both ends, at worst (the engine knows each tensor's
                  file offset and counts the exact union, at most this); u = `PlanOptions.map_unit`, what one fault
                  maps on the workers' hosts (`engine.offload.map_unit()`: 64 KiB, or a 2 MiB huge page);
                copy (cpu, c ≠ b): min(2, m) × products + the largest single read's `mapped_bound` (the two buffers
                  and the pages of the read being copied);
                device (cuda): min(2, m) × products, each product (int8: its values and its scales) rounded up to
                  `DEVICE_ALIGN` (two device buffers the layers are copied into from pinned host memory).
  k           = the most leading layers with resident(k) + working(n − k) ≤ B; none fits when k = 0 does not.
  streamed    = (n − k) × products per step: one forward (a decode step: one token at batch 1) reads each once.

With int8 (`--quantize int8`) every product counts its int8 bytes instead of P × b (values plus a float16 scale and
minimum per group: `Quantization.weight_bytes`), resident or streamed, and the streamed ones map the int8 copy of
the layers (`engine.int8_copy`: zero copy on cpu), values and scales apart, one file per layer: working(m) =
min(2, m) × the lesser of Σ over the layer's `Part.int8_spans` of `mapped_bound(span, u)` and `mapped_bound` of the
whole layer's int8 bytes (`Part.int8_whole`: its file's data, which small reads' rounded units would overcount).

`propose` lays a proposal out as `shardmesh up --memory-budget B` deploys it: the coordinator's even split, one
budget for every worker (the tightest device's memory less the reserve and everything but weights at its peak:
the KV cache, activations, runtime, buffers and the load transient of `memory.shard_memory`, rounded down to MiB).

Step time (`OffloadProposal.step`): stages run one after another for a token; each stage takes its slowest rank's
streamed bytes / link rate (every device streams over its own link) plus, when a memory rate is known, its
resident weights but the embedding (a lookup) / memory rate. Prefetch overlaps a streamed layer's transfer with
the previous layer's compute, so a link-bound step is about this; compute and the hops between stages are not
counted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from shardmesh.core.dtypes import INT8_GROUP, DType, Quantization
from shardmesh.core.layout import split_layers
from shardmesh.planning.devices import Device, compact_bytes, describe_devices, gb
from shardmesh.planning.memory import ModelInfo, ShardMemory
from shardmesh.planning.weights import Part, weight_parts

if TYPE_CHECKING:
    from shardmesh.planning.planner import PlanOptions

# `shardmesh.engine.offload.FAULT_AROUND` (that module imports torch; a test checks the two agree): Linux maps up
# to this much around a read fault on a file mapping, so a streamed read holds its bytes rounded out to it (more
# where huge pages map the page cache: `PlanOptions.map_unit`).
FAULT_AROUND = 64 * 1024
# `shardmesh.engine.host_offload.ALIGN`: each product a CUDA worker streams starts at a multiple of this in its buffers
DEVICE_ALIGN = 256
MiB = 2**20
ZERO_COPY, COPY, DEVICE = "zero-copy", "copy", "device"
WORKING_SET = {ZERO_COPY: "two layers' mapped pages",
               COPY: "two layer buffers + one read's pages", DEVICE: "two layer buffers"}  # fmt: skip


def gbs(rate: float) -> str:
    return f"{rate / 1e9:.2f} GB/s"


@dataclass(frozen=True)
class Rate:
    """A rate in bytes per second, and where the number came from (measured here, or given by a flag)."""

    bytes_per_s: float
    source: str

    def describe(self) -> str:
        return f"{gbs(self.bytes_per_s)} ({self.source})"


@dataclass(frozen=True)
class LinkRates:
    """The rates a step time is predicted from: `link` brings streamed weights to the device (page cache into the
    process on cpu, host to device on cuda); `memory` reads resident weights (None: not counted); `disk` reads
    the checkpoint when the page cache does not hold the streamed layers (None: not known)."""

    link: Rate
    memory: Rate | None = None
    disk: Rate | None = None

    def __post_init__(self) -> None:
        for name in ("link", "memory", "disk"):
            rate = getattr(self, name)
            if rate is not None and not rate.bytes_per_s > 0:
                raise ValueError(f"{name} rate must be > 0 bytes/s, got {rate.bytes_per_s}")


def mapped_bound(nbytes: int, unit: int = FAULT_AROUND) -> int:
    """The most a read of `nbytes` contiguous bytes maps: rounded out to `unit` on both ends, where it straddles
    one more unit than its length needs."""
    if nbytes <= 0:
        return 0
    return unit * (-(-(nbytes - 1) // unit) + 1)


def streaming_mode(device: str, checkpoint_dtype: str, dtype: str, quantization: str = "none") -> str:
    """How streamed weights reach the products: mapped as stored (cpu, the same dtype, or int8 from the int8 copy),
    copy-converted (cpu), or copied to the device (cuda)."""
    if device != "cpu":
        return DEVICE
    int8 = Quantization.parse(quantization) is Quantization.INT8
    return ZERO_COPY if int8 or DType.parse(checkpoint_dtype) == DType.parse(dtype) else COPY


def product_bytes(layer: Part, dtype: DType, quantization: Quantization = Quantization.NONE) -> int:
    """One layer's products as a rank holds them: in `dtype`, or int8 values and their groups' scales."""
    return sum(quantization.weight_bytes(o, i, dtype) for o, i in layer.products)


def working_set(layer: Part, streaming: int, b: int, c: int, mode: str, unit: int = FAULT_AROUND,
                quantization: str = "none") -> int:  # fmt: skip
    """Bytes of the streamed weights in a worker at once with `streaming` layers streamed (module docstring)."""
    if streaming == 0:
        return 0
    two = min(2, streaming)
    q = Quantization.parse(quantization)
    if mode == ZERO_COPY and q is Quantization.INT8:  # the reads lie in one file per layer: at most all of its data
        reads = sum(mapped_bound(span, unit) for span in layer.int8_spans)
        return two * min(reads, mapped_bound(layer.int8_whole, unit))
    if mode == ZERO_COPY:
        return two * sum(mapped_bound(span * c, unit) for span in layer.spans)
    if mode == DEVICE:  # two device buffers of one layer's products packed back to back, each aligned
        int8 = q is Quantization.INT8
        sizes = [(o * i, o * -(-i // INT8_GROUP) * 4) if int8 else (o * i * b,) for o, i in layer.products]
        return two * sum(-(-n // DEVICE_ALIGN) * DEVICE_ALIGN for size in sizes for n in size)
    products = sum(o * i for o, i in layer.products) * b
    largest_read = max((mapped_bound(span * c, unit) for span in layer.spans), default=0)
    return two * products + (largest_read if mode == COPY else 0)


@dataclass(frozen=True)
class Residency:
    """One shard under a budget: its leading `resident` layers loaded, the `streamed` trailing ones streamed."""

    layers: tuple[int, int]
    budget: int
    resident: int
    streamed: int
    resident_bytes: int  # every parameter loaded: numel × serving dtype size (int8 products: their int8 bytes)
    working_set_bytes: int  # the streamed weights in the worker at once
    streamed_bytes_per_step: int  # the streamed layers' products, once per forward
    layer_bytes: int  # one layer's products on this rank, in the serving dtype (or int8)

    @property
    def total_bytes(self) -> int:
        """What the budget counts: resident plus working set (`engine.offload.OffloadPlan.total_bytes`)."""
        return self.resident_bytes + self.working_set_bytes

    @property
    def resident_range(self) -> tuple[int, int]:
        return self.layers[0], self.layers[0] + self.resident

    @property
    def streamed_range(self) -> tuple[int, int]:
        return self.layers[0] + self.resident, self.layers[1]


def residency(model: ModelInfo, layers: tuple[int, int], tp: int, rank: int, dtype: str, budget: int,
              mode: str, unit: int = FAULT_AROUND, quantization: str = "none") -> Residency | None:  # fmt: skip
    """The split of the shard [start, end) × rank `rank` of `tp` under `budget` bytes of weights, as the engine
    makes it: the most leading layers resident next to the streamed ones' working set; None when even every layer
    streamed does not fit."""
    cfg, serving = model.cfg, DType.parse(dtype)
    start, end = layers
    if not 0 <= start < end <= cfg.num_layers:
        raise ValueError(f"layer range [{start}, {end}) is not within [0, {cfg.num_layers})")
    parts = weight_parts(cfg, tp, rank)
    b, c = serving.itemsize, DType.parse(model.checkpoint_dtype).itemsize
    n, q = end - start, Quantization.parse(quantization)
    loaded = n * parts.layer.nbytes(serving, q)
    loaded += parts.embedding.nbytes(serving) * (start == 0)
    loaded += parts.head.nbytes(serving, q) * (end == cfg.num_layers)
    per_layer = product_bytes(parts.layer, serving, q)
    for resident in range(n, -1, -1):
        streaming = n - resident
        held = loaded - streaming * per_layer
        working = working_set(parts.layer, streaming, b, c, mode, unit, quantization)
        if held + working <= budget:
            return Residency(layers, budget, resident, streaming, held, working, streaming * per_layer, per_layer)
    return None


@dataclass(frozen=True)
class OffloadShard:
    """One worker of an offload proposal: its device, its split, and its peak with that split."""

    stage: int
    tp_rank: int
    device: Device
    residency: Residency
    memory: ShardMemory  # `weights` = resident + working set
    embedding_bytes: int  # resident but not read per step (a lookup)

    @property
    def headroom(self) -> int:
        return self.device.memory - self.memory.total

    @property
    def read_bytes(self) -> int:
        """Resident weights read every step: all but the embedding."""
        return self.residency.resident_bytes - self.embedding_bytes


@dataclass(frozen=True)
class OffloadProposal:
    """Offload on the given devices: the layout, every worker's split and the numbers of a step."""

    model: ModelInfo
    dtype: str
    tp: int
    pp: int
    mode: str
    budget: int  # `--memory-budget`: bytes of weights per worker
    shards: tuple[OffloadShard, ...]  # global rank order
    rates: LinkRates | None
    full_layer_bytes: int  # one layer's four products, whole (every rank's), as stored in the checkpoint
    reserve: int = 0  # bytes every device keeps free beyond the peak
    map_unit: int = FAULT_AROUND  # what a mapped read rounds out to (`PlanOptions.map_unit`)
    quantization: str = "none"  # int8: products held and streamed in int8 (`full_layer_bytes`: the int8 copy's)

    @property
    def int8(self) -> bool:
        return Quantization.parse(self.quantization) is Quantization.INT8

    @property
    def streamed_layers(self) -> int:
        return sum(max(sh.residency.streamed for sh in self.stage(s)) for s in range(self.pp))

    def stage(self, s: int) -> list[OffloadShard]:
        return [sh for sh in self.shards if sh.stage == s]

    def critical(self, s: int) -> OffloadShard:
        """The rank of stage `s` a step waits for: the most streamed bytes, then the most resident ones."""
        return max(self.stage(s), key=lambda sh: (sh.residency.streamed_bytes_per_step, sh.read_bytes))

    @property
    def streamed_bytes_per_step(self) -> int:
        """Bytes the step waits on the links for: each stage's slowest rank, stages one after another."""
        return sum(self.critical(s).residency.streamed_bytes_per_step for s in range(self.pp))

    @property
    def read_bytes_per_step(self) -> int:
        return sum(self.critical(s).read_bytes for s in range(self.pp))

    def host_layers(self) -> dict[str, int]:
        """Streamed layers per node: whole layers in host memory, every rank of a stage streaming its slice of the
        same tensors."""
        out: dict[str, int] = {}
        for s in range(self.pp):
            ranks = self.stage(s)
            node = ranks[0].device.node
            out[node] = out.get(node, 0) + max(sh.residency.streamed for sh in ranks)
        return out

    def host_bytes(self) -> dict[str, int]:
        """Host memory per node for the streamed layers as stored (the checkpoint's pages)."""
        return {node: n * self.full_layer_bytes for node, n in self.host_layers().items()}

    def step_seconds(self) -> float | None:
        """The predicted time of one decode step (module docstring); None without a link rate."""
        if self.rates is None:
            return None
        total = 0.0
        for s in range(self.pp):
            times = []
            for sh in self.stage(s):
                t = sh.residency.streamed_bytes_per_step / self.rates.link.bytes_per_s
                if self.rates.memory is not None:
                    t += sh.read_bytes / self.rates.memory.bytes_per_s
                times.append(t)
            total += max(times)
        return total

    @property
    def min_headroom(self) -> int:
        return min(sh.headroom for sh in self.shards)

    def rank_key(self) -> tuple[float, int, int]:
        """Lower is better: the predicted step (or the bytes it waits for), fewer stages, more headroom."""
        step = self.step_seconds()
        return (step if step is not None else float(self.streamed_bytes_per_step), self.pp, -self.min_headroom)

    def describe(self) -> list[str]:
        """The proposal's lines: the command, each stage's split and peak, the bytes streamed, the host memory and
        the step time, each a product a person can check."""
        p, b = self, DType.parse(self.dtype).itemsize
        devices = describe_devices(tuple(sh.device for sh in p.shards))
        n = len(p.shards)
        what = f"{p.dtype} with int8 products (--quantize int8 " if p.int8 else f"{p.dtype} ("
        lines = [f"offload in {what}--memory-budget {compact_bytes(p.budget)}, {p.mode}): tp={p.tp} × "
                 f"pp={p.pp} on {n} device{'s' * (n > 1)} ({devices}), layers split evenly"]  # fmt: skip
        working = WORKING_SET[p.mode] + ("; o and down map whole rows" if p.mode == ZERO_COPY and p.tp > 1 else "")
        unit = f"{p.map_unit // MiB} MiB" if p.map_unit % MiB == 0 else f"{p.map_unit // 1024} KiB"
        working += f", reads rounded out to {unit}" if p.mode != DEVICE else ""
        less = f" less the {compact_bytes(p.reserve)} reserve" if p.reserve else ""
        for s in range(p.pp):
            sh = self.critical(s)
            r, m = sh.residency, sh.memory
            alike = len({(x.residency.resident, x.residency.total_bytes) for x in self.stage(s)}) == 1
            each = "each rank" if alike else f"rank {sh.tp_rank}, its slowest"
            lines.append(
                f"stage {s} [{r.layers[0]}, {r.layers[1]}), {each}: {r.resident} layers resident + {r.streamed} "
                f"streamed; weights {gb(r.resident_bytes)} resident + {gb(r.working_set_bytes)} streaming "
                f"({working}) = {gb(r.total_bytes)} of the budget; + KV cache {gb(m.kv_cache)} + other "
                f"{gb(m.other)} = {gb(m.total)} of {gb(sh.device.memory - p.reserve)} "
                f"({compact_bytes(sh.device.memory)}{less})"
            )
        per = self.critical(0).residency.layer_bytes
        each = (f"{per / 1e6:.1f} MB of int8 values and scales per rank" if p.int8
                else f"{per // b / 1e6:.1f}M weights per rank × {b} bytes")  # fmt: skip
        lines.append(f"streamed per step (one token at batch 1): {gb(self.streamed_bytes_per_step)} = "
                     f"{self.streamed_layers} layers × {each}")  # fmt: skip
        c = DType.parse(self.model.checkpoint_dtype).itemsize
        stored = "the int8 copy's" if p.int8 else "the checkpoint's"
        where = f"{stored} pages in the page cache" if p.mode != DEVICE else "host memory to copy from"
        layer = (f"{self.full_layer_bytes / 1e6:.1f} MB of int8 values and scales" if p.int8
                 else f"{self.full_layer_bytes // c / 1e6:.1f}M weights × {c} bytes")  # fmt: skip
        host = "; ".join(f"{gb(n * self.full_layer_bytes)} on {node} = {n} layers × {layer}"
                         for node, n in self.host_layers().items())  # fmt: skip
        lines.append(f"host memory for the streamed layers as stored ({where}): {host}")
        return lines + self._describe_step()

    def _describe_step(self) -> list[str]:
        step, rates, streamed = self.step_seconds(), self.rates, self.streamed_bytes_per_step
        if step is None or rates is None:
            return ["step time: not predicted: give --link-bandwidth, the rate weights reach a device (host to "
                    "device for cuda, e.g. a PCIe link's measured rate)"]  # fmt: skip
        text = f"step ≈ {step:.3f} s per token at batch 1 = {gb(streamed)} / {gbs(rates.link.bytes_per_s)} link"
        if rates.memory is not None:
            text += f" + {gb(self.read_bytes_per_step)} resident / {gbs(rates.memory.bytes_per_s)} memory"
        else:
            text += " (resident weights' reads not counted: no memory rate)"
        text += "; compute and hops not counted"
        if rates.disk is not None and self.mode != DEVICE:
            text += (f"; cold (the page cache short of them): {gb(streamed)} / {gbs(rates.disk.bytes_per_s)} disk = "
                     f"{streamed / rates.disk.bytes_per_s:.2f} s more")  # fmt: skip
        used = [(name, r) for name, r in (("link", rates.link), ("memory", rates.memory), ("disk", rates.disk))
                if r is not None and (name != "disk" or self.mode != DEVICE)]  # fmt: skip
        return [text, "rates: " + "; ".join(f"{name} {r.describe()}" for name, r in used)]

    def to_json(self) -> dict[str, Any]:
        rates = self.rates
        return {
            "tp": self.tp, "pp": self.pp, "dtype": self.dtype, "quantization": self.quantization, "mode": self.mode,
            "memory_budget": self.budget,
            "map_unit": self.map_unit,
            "streamed_bytes_per_step": self.streamed_bytes_per_step, "read_bytes_per_step": self.read_bytes_per_step,
            "host_bytes": self.host_bytes(), "step_seconds": self.step_seconds(),
            "rates": None if rates is None else {
                name: None if r is None else {"bytes_per_s": r.bytes_per_s, "source": r.source}
                for name, r in (("link", rates.link), ("memory", rates.memory), ("disk", rates.disk))},
            "shards": [
                {"rank": i, "stage": sh.stage, "tp_rank": sh.tp_rank, "node": sh.device.node,
                 "device": sh.device.index, "layers": list(sh.residency.layers),
                 "resident_layers": list(sh.residency.resident_range),
                 "streamed_layers": list(sh.residency.streamed_range),
                 "resident_bytes": sh.residency.resident_bytes, "working_set_bytes": sh.residency.working_set_bytes,
                 "streamed_bytes_per_step": sh.residency.streamed_bytes_per_step, "kv_cache": sh.memory.kv_cache,
                 "other": sh.memory.other, "total": sh.memory.total, "device_memory": sh.device.memory,
                 "headroom": sh.headroom}
                for i, sh in enumerate(self.shards)
            ],
        }  # fmt: skip


def propose(
    model: ModelInfo, groups: list[tuple[Device, ...]], tp: int, options: PlanOptions
) -> OffloadProposal | None:
    """Offload on these tensor groups (one per stage, in pipeline order) with the even split and one budget for
    every worker (module docstring); None when a worker cannot hold its shard even with every layer streamed."""
    cfg, pp = model.cfg, len(groups)
    if not 1 <= pp <= cfg.num_layers:
        return None
    split = split_layers(cfg.num_layers, pp)
    serving = [(s, r, d, options.shard(model, split[s], tp, r)) for s, g in enumerate(groups) for r, d in enumerate(g)]
    room = min(d.memory - options.reserve - (m.total - m.weights) for _, _, d, m in serving)
    budget = room // MiB * MiB
    if budget <= 0:
        return None
    mode = streaming_mode(options.runtime.device, model.checkpoint_dtype, options.dtype, options.quantization)
    shards = []
    for s, r, d, m in serving:
        res = residency(model, split[s], tp, r, options.dtype, budget, mode, options.map_unit, options.quantization)
        if res is None:
            return None
        embedding = weight_parts(cfg, tp, r).embedding.nbytes(DType.parse(options.dtype)) if s == 0 else 0
        shards.append(OffloadShard(s, r, d, res, replace(m, weights=res.total_bytes), embedding))
    q, stored = Quantization.parse(options.quantization), DType.parse(model.checkpoint_dtype)
    full_bytes = product_bytes(weight_parts(cfg, 1, 0).layer, stored, q)  # as the checkpoint, or its int8 copy, holds
    return OffloadProposal(model, options.dtype, tp, pp, mode, budget, tuple(shards), options.rates, full_bytes,
                           options.reserve, options.map_unit, options.quantization)  # fmt: skip
