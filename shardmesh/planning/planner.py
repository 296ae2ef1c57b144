"""Choose tensor degree, pipeline stages and the layer split for given devices: pure functions.

The search, for every valid tensor degree `tp` (`valid_tp_degrees`: divides the query heads and the
MLP width, divides or is a multiple of the kv heads; capped by `PlanOptions.tp` and the largest node):

1. **Tensor groups inside nodes.** Each node's devices, largest memory first, are cut into groups
   of `tp`; a node's remainder (its smallest devices) is left unused. A group never spans nodes.
2. **Stages.** Every group is one pipeline stage (at most one per layer; with `PlanOptions.pp` the
   `pp` groups with the most memory), ordered by node (`node_order`, else as listed), so the pipeline
   crosses each node boundary once. The first stage also holds the embedding, the last the LM head.
   A group that cannot hold even one layer is left out (unless `pp` is fixed).
3. **Layer capacity.** `cap_s` = the most layers stage `s` holds with every rank's predicted peak
   (`memory.shard_memory(...).total`) plus `reserve` within its device's memory. It fits iff every
   `cap_s >= 1` and `Σ cap_s >= num_layers`.
4. **Split.** Layers are shared in proportion to each stage's free memory (balance "memory": the
   tightest rank's memory less the reserve and the stage's fixed costs, `free_memory`) or to its speed
   (the slowest rank's; balance "speed"), by `shardmesh.core.layout.split_layers`; if that leaves a
   stage over its capacity, by `layout.capped_split` (proportional shares clipped at each capacity, the
   rest shared among the others).

Every memory figure is the memory model's for the options' dtype and quantization (`PlanOptions.quantization`:
with int8 the layers' products and the LM head take 1 byte per weight plus a float16 scale and minimum per 32 inputs
of a row).

Among the layouts that fit, the plan uses the most devices, then the fewest pipeline stages (each stage
adds a hop to every token; tensor groups stay inside a node), then keeps the most headroom on its
tightest device. When none fits, `Infeasible` says how many bytes are missing, the model's weights in
the serving dtype and in int8 against the devices' memory, and which single change would fit, each with
the plan it gives (int8 weights on the same devices, another dtype, more devices of the largest size in
the serving dtype and with int8, a shorter context, fewer KV slots) and offload: the same devices keeping the
leading layers of each shard resident and streaming the rest every step (`shardmesh.planning.offload`: the
budget, each stage's split, the bytes streamed per step, the host memory they need and, from `PlanOptions.rates`,
the predicted step time; with int8, products held and streamed in int8, and int8 with offload where int8 alone
does not fit the same devices).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from shardmesh.core.dtypes import DType, Quantization
from shardmesh.core.heads import HeadSplit, valid_tp_degrees
from shardmesh.core.layout import capped_split, layer_counts, split_layers
from shardmesh.core.topology import ServingLimits
from shardmesh.core.units import format_bytes
from shardmesh.planning.devices import Device, compact_bytes, describe_devices, gb, nodes_of
from shardmesh.planning.kv_blocks import block_bytes
from shardmesh.planning.memory import ModelInfo, RuntimeCosts, ShardMemory, shard_memory, stage_memory
from shardmesh.planning.offload import FAULT_AROUND, LinkRates, OffloadProposal, propose
from shardmesh.planning.weights import weight_parts

BALANCES = ("memory", "speed")


class PlanError(ValueError):
    """A request the planner cannot even try (an invalid tensor degree, too few devices per node)."""


@dataclass(frozen=True)
class Suggestion:
    """One change that makes the plan fit: what to do, in words and as option values, and the plan it gives."""

    text: str
    changes: dict[str, object]
    plan: Plan | None = None
    offload: OffloadProposal | None = None


@dataclass(frozen=True)
class Totals:
    """The whole model's weights beside the devices' memory, for a person to check the proposals by hand."""

    parameters: int
    weights: dict[str, int]  # bytes, by `Quantization` name
    devices: str  # as `--devices` spells them
    budget: int  # bytes all the devices have for shards: memory less the reserve, summed

    def describe(self, dtype: str) -> str:
        none, int8 = self.weights[Quantization.NONE.value], self.weights[Quantization.INT8.value]
        return (f"weights: {self.parameters / 1e9:.2f}B parameters = {gb(none)} in {dtype}, {gb(int8)} with "
                f"--quantize int8 (layers' products and LM head 1 byte per weight + 4 per 32 inputs of a row; "
                f"embedding and norms in {dtype}); devices: {self.devices} = {gb(self.budget)} in all")  # fmt: skip


class Infeasible(PlanError):
    """The model does not fit the devices; the message says by how much and what would fit."""

    def __init__(self, summary: str, missing: int, closest: str, suggestions: list[Suggestion],
                 totals: Totals | None = None, dtype: str = DType.BFLOAT16) -> None:  # fmt: skip
        self.summary, self.missing, self.closest, self.suggestions = summary, missing, closest, suggestions
        self.totals = totals
        lines = [f"{summary}: {format_bytes(missing)} missing ({missing} bytes); closest layout: {closest}"]
        if totals is not None:
            lines.append(totals.describe(dtype))
        if suggestions:
            lines.append("options that fit:")
            lines += [f"  - {s.text}" for s in suggestions]
        else:
            lines.append("no single change of quantization, dtype, device count, context or KV slots makes it fit")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class PlanOptions:
    """What to plan for; `tp` / `pp` None means choose."""

    dtype: str = DType.BFLOAT16  # a `DType` name
    limits: ServingLimits = field(default_factory=lambda: ServingLimits(8, 4096, 4096))
    runtime: RuntimeCosts = field(default_factory=RuntimeCosts)
    tp: int | None = None
    pp: int | None = None
    balance: str = "memory"
    node_order: tuple[str, ...] = ()
    reserve: int = 0  # bytes every device keeps free beyond the predicted peak
    # A `Quantization` name: how the layers' products are stored. Last, so positional construction keeps working.
    quantization: str = Quantization.NONE.value
    # The rates an offload proposal's step time is predicted from (None: bytes only, no time).
    rates: LinkRates | None = None
    # What a streamed read's mapped pages round out to on the workers' hosts (`engine.offload.map_unit()`).
    map_unit: int = FAULT_AROUND
    # Each tp rank's share of the MLP and the vocabulary (`--tp-split`), for groups of as many ranks; () even.
    tp_split: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        try:
            DType.parse(self.dtype)
            Quantization.parse(self.quantization)
        except ValueError as e:
            raise PlanError(str(e)) from None
        if self.balance not in BALANCES:
            raise PlanError(f"balance must be one of {', '.join(BALANCES)}, got {self.balance!r}")
        for name in ("tp", "pp"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise PlanError(f"{name} must be >= 1, got {v}")
        if self.reserve < 0:
            raise PlanError(f"reserve must be >= 0 bytes, got {self.reserve}")

    def stage(self, model: ModelInfo, n: int, first: bool, last: bool, tp: int, rank: int) -> ShardMemory:
        """`memory.stage_memory` with these options' dtype, quantization, limits and runtime."""
        return stage_memory(model, n, first, last, tp, rank, self.dtype, self.limits, self.runtime, self.quantization,
                            self._split(tp))  # fmt: skip

    def shard(self, model: ModelInfo, layers: tuple[int, int], tp: int, rank: int) -> ShardMemory:
        """`memory.shard_memory` with these options."""
        return shard_memory(model, layers, tp, rank, self.dtype, self.limits, self.runtime, self.quantization,
                            self._split(tp))  # fmt: skip

    def _split(self, tp: int) -> tuple[int, ...]:
        """`tp_split` for a group of `tp` ranks, () (even) for a group of another size (a plan choosing tp)."""
        return self.tp_split if len(self.tp_split) == tp else ()


@dataclass(frozen=True)
class ShardPlan:
    """One process: stage × tensor rank, on one device."""

    stage: int
    tp_rank: int
    rank: int  # global rank = stage × tp + tp_rank
    device: Device
    layers: tuple[int, int]
    memory: ShardMemory

    @property
    def headroom(self) -> int:
        return self.device.memory - self.memory.total


@dataclass(frozen=True)
class Plan:
    model: ModelInfo
    options: PlanOptions
    tp: int
    pp: int
    shards: tuple[ShardPlan, ...]  # global rank order
    unused: tuple[Device, ...]

    @property
    def layer_split(self) -> tuple[tuple[int, int], ...]:
        return tuple(sh.layers for sh in self.shards if sh.tp_rank == 0)

    @property
    def min_headroom(self) -> int:
        return min(sh.headroom for sh in self.shards)

    @property
    def fits(self) -> bool:
        """Every device keeps at least `reserve` bytes free at its predicted peak."""
        return self.min_headroom >= self.options.reserve

    @property
    def even_split(self) -> bool:
        """Whether the split is the one `split_layers` gives without weights (what the coordinator uses)."""
        return list(self.layer_split) == split_layers(self.model.cfg.num_layers, self.pp)


# --- pure building blocks -----------------------------------------------------------------------------------


def tensor_groups(devices: tuple[Device, ...], tp: int, node_order: tuple[str, ...] = ()) -> list[tuple[Device, ...]]:
    """Groups of `tp` devices of one node each, in pipeline order; a node's leftover devices are unused.

    Within a node the devices are taken largest memory first (then fastest), so a group's members are
    as alike as possible: every rank of a stage holds about the same bytes.
    """
    by_node = nodes_of(devices)
    order = [n for n in node_order if n in by_node] + [n for n in by_node if n not in node_order]
    groups = []
    for node in order:
        ds = sorted(by_node[node], key=lambda d: (-d.memory, -d.speed, d.index))
        groups += [tuple(ds[i : i + tp]) for i in range(0, len(ds) - tp + 1, tp)]
    return groups


def stage_capacity(model: ModelInfo, group: tuple[Device, ...], first: bool, last: bool, max_layers: int,
                   options: PlanOptions) -> int:  # fmt: skip
    """The most layers (<= max_layers) this group holds at this position with every rank within memory."""

    def fits(n: int) -> bool:
        return all(options.stage(model, n, first, last, len(group), r).total + options.reserve <= d.memory
                   for r, d in enumerate(group))  # fmt: skip

    if max_layers < 1 or not fits(1):
        return 0
    lo, hi = 1, max_layers  # fits(lo) holds; find the largest n that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def free_memory(model: ModelInfo, group: tuple[Device, ...], first: bool, last: bool, options: PlanOptions) -> int:
    """Bytes the group's tightest rank has for layers at this position: its memory less the reserve and
    everything a one-layer shard needs besides that layer's weights and KV cache."""
    free = []
    for r, d in enumerate(group):
        one = options.stage(model, 1, first, last, len(group), r)
        free.append(d.memory - options.reserve - (one.total - one.weights - one.kv_cache))
    return min(free)


@dataclass(frozen=True)
class _Attempt:
    """One layout tried: a plan when it fits, else how far it is from fitting."""

    tp: int
    groups: list[tuple[Device, ...]]
    caps: list[int]
    plan: Plan | None
    missing: int


def _layer_cost(model: ModelInfo, tp: int, options: PlanOptions) -> int:
    """Bytes one more layer costs a whole stage (all its ranks): weights plus KV cache."""
    total = 0
    for r in range(tp):
        one = options.stage(model, 1, False, False, tp, r)
        total += one.weights + one.kv_cache
    return total


def _stage_groups(model: ModelInfo, devices: tuple[Device, ...], tp: int,
                  options: PlanOptions) -> list[tuple[Device, ...]]:  # fmt: skip
    """The tensor groups that become stages, in pipeline order: with `options.pp` the `pp` with the most memory,
    at most one per layer; [] when there are too few."""
    groups = tensor_groups(devices, tp, options.node_order)
    if options.pp is not None:
        if options.pp > len(groups):
            return []
        keep = sorted(range(len(groups)), key=lambda i: -min(d.memory for d in groups[i]))[: options.pp]
        groups = [g for i, g in enumerate(groups) if i in keep]
    return groups[: model.cfg.num_layers]


def _attempt(model: ModelInfo, devices: tuple[Device, ...], tp: int, options: PlanOptions) -> _Attempt | None:
    num_layers = model.cfg.num_layers
    groups = _stage_groups(model, devices, tp, options)
    if not groups:
        return None
    while True:  # a group that cannot hold one layer is left out (unless pp is fixed), and the rest re-sized
        pp = len(groups)
        caps = [stage_capacity(model, g, s == 0, s == pp - 1, num_layers - (pp - 1), options)
                for s, g in enumerate(groups)]  # fmt: skip
        keep = [g for g, c in zip(groups, caps, strict=True) if c >= 1]
        if options.pp is not None or not keep or len(keep) == len(groups):
            break
        groups = keep
    if min(caps) >= 1 and sum(caps) >= num_layers:
        if options.balance == "memory":
            weights = [float(free_memory(model, g, s == 0, s == pp - 1, options)) for s, g in enumerate(groups)]
        else:
            weights = [min(d.speed for d in g) for g in groups]
        split = split_layers(num_layers, pp, weights)
        if any(n > c for n, c in zip(layer_counts(split), caps, strict=True)):
            split = capped_split(num_layers, weights, caps)
        shards = []
        for s, (g, rng) in enumerate(zip(groups, split, strict=True)):
            for r, d in enumerate(g):
                mem = options.shard(model, rng, tp, r)
                shards.append(ShardPlan(s, r, s * tp + r, d, rng, mem))
        used = {sh.device for sh in shards}
        plan = Plan(model, options, tp, pp, tuple(shards), tuple(d for d in devices if d not in used))
        assert plan.min_headroom >= options.reserve, plan
        return _Attempt(tp, groups, caps, plan, 0)
    # How far from fitting: stages that cannot hold one layer miss what one layer needs there; the
    # layers nobody can hold miss a whole layer (weights + KV, every rank) each.
    missing = 0
    for s, (g, c) in enumerate(zip(groups, caps, strict=True)):
        if c == 0:
            for r, d in enumerate(g):
                need = options.stage(model, 1, s == 0, s == pp - 1, tp, r).total
                missing += max(0, need + options.reserve - d.memory)
    missing += max(0, num_layers - sum(max(c, 1) for c in caps)) * _layer_cost(model, tp, options)
    return _Attempt(tp, groups, caps, None, missing)


def _degrees(model: ModelInfo, devices: tuple[Device, ...], options: PlanOptions) -> list[int]:
    """The tensor degrees to try: valid for the model, `options.tp` if set, within the largest node."""
    degrees = valid_tp_degrees(model.cfg)
    if options.tp is not None:
        if options.tp not in degrees:
            raise PlanError(f"tensor degree {options.tp} is not valid for this model (num_attention_heads="
                            f"{model.cfg.num_heads}, num_key_value_heads={model.cfg.num_kv_heads}, intermediate_size="
                            f"{model.cfg.intermediate_size}); valid degrees: {degrees}")  # fmt: skip
        degrees = [options.tp]
    largest_node = max(len(ds) for ds in nodes_of(devices).values())
    usable = [d for d in degrees if d <= largest_node]
    if not usable:
        raise PlanError(f"tensor degree {degrees[0]} needs {degrees[0]} devices on one node; the largest node has "
                        f"{largest_node} (tensor groups never span nodes)")  # fmt: skip
    return usable


def _attempts(model: ModelInfo, devices: tuple[Device, ...], options: PlanOptions) -> list[_Attempt]:
    usable = _degrees(model, devices, options)
    out = [a for tp in usable if (a := _attempt(model, devices, tp, options)) is not None]
    if not out:
        raise PlanError(f"pipeline degree {options.pp} needs {options.pp} tensor groups; these devices form fewer "
                        f"for every valid tensor degree {usable}")  # fmt: skip
    return out


def _best(attempts: list[_Attempt]) -> Plan | None:
    plans = [a.plan for a in attempts if a.plan is not None]
    if not plans:
        return None
    return max(plans, key=lambda p: (len(p.shards), -p.pp, p.min_headroom))


def try_plan(model: ModelInfo, devices: tuple[Device, ...], options: PlanOptions) -> Plan | None:
    """The chosen plan, or None when nothing fits (PlanError for requests that cannot be tried)."""
    if not devices:
        raise PlanError("no devices to plan on")
    return _best(_attempts(model, devices, options))


def plan(model: ModelInfo, devices: tuple[Device, ...], options: PlanOptions) -> Plan:
    """The chosen plan; `Infeasible` (with the missing bytes and options that fit) when nothing fits."""
    attempts = _attempts(model, devices, options)
    chosen = _best(attempts)
    if chosen is not None:
        return chosen
    closest = min(attempts, key=lambda a: (a.missing, -len(a.groups) * a.tp))
    pp = len(closest.groups)
    caps = ", ".join(str(c) for c in closest.caps)
    where = (f"tp={closest.tp} × pp={pp} on {pp * closest.tp} of {len(devices)} devices, stages hold at most "
             f"[{caps}] of {model.cfg.num_layers} layers")  # fmt: skip
    lim = options.limits
    quant = ", int8" if options.quantization == Quantization.INT8.value else ""
    summary = (f"{model.name} ({options.dtype}{quant}, {lim.kv_slots} KV slots × {lim.max_context} tokens) does not "
               f"fit on {describe_devices(devices)}")  # fmt: skip
    raise Infeasible(summary, closest.missing, where, suggest(model, devices, options), totals(model, devices, options),
                     options.dtype)  # fmt: skip


def fill_kv_blocks(p: Plan, block_size: int) -> int:
    """The most KV blocks of `block_size` tokens every shard of `p` holds in what its device has left (less
    `reserve`) beside its weights, buffers, activations and runtime: a paged cache sized from the memory at hand.
    Block ids are mesh-wide, so the shard with the least room for blocks sets the number (0: no room at all)."""
    cfg, b = p.model.cfg, DType.parse(p.options.dtype).itemsize
    counts = []
    for sh in p.shards:
        m = sh.memory
        # Serving peak = runtime + weights + buffers + kv + activations; loading's transient comes before the cache.
        room = sh.device.memory - p.options.reserve - m.runtime - m.weights - m.buffers - m.activations
        if room < m.load - m.activations:  # loading alone would not fit what is left
            return 0
        split = HeadSplit.of(cfg, sh.tp_rank, p.tp)
        one = block_bytes(sh.layers[1] - sh.layers[0], split.kv_count, cfg.head_dim, cfg.hidden_size, block_size, b,
                          sh.layers[1] == cfg.num_layers)  # fmt: skip
        counts.append(max(0, room) // one)
    return min(counts)


def resplit(p: Plan, split: list[tuple[int, int]]) -> Plan:
    """The same devices, tensor groups and stages with another layer split (it may not fit: see `Plan.fits`)."""
    if len(split) != p.pp:
        raise ValueError(f"need {p.pp} layer ranges, got {len(split)}")
    shards = tuple(ShardPlan(sh.stage, sh.tp_rank, sh.rank, sh.device, split[sh.stage],
                             p.options.shard(p.model, split[sh.stage], p.tp, sh.tp_rank))
                   for sh in p.shards)  # fmt: skip
    return replace(p, shards=shards)


def even(p: Plan) -> Plan:
    """The plan with the even split the coordinator uses (`split_layers` without weights)."""
    return resplit(p, split_layers(p.model.cfg.num_layers, p.pp))


# --- what would fit -----------------------------------------------------------------------------------------


def _try(model: ModelInfo, devices: tuple[Device, ...], options: PlanOptions) -> Plan | None:
    try:
        return try_plan(model, devices, options)
    except PlanError:
        return None


def _fits(model: ModelInfo, devices: tuple[Device, ...], options: PlanOptions) -> bool:
    return _try(model, devices, options) is not None


def totals(model: ModelInfo, devices: tuple[Device, ...], options: PlanOptions) -> Totals:
    """The whole model's parameters and weight bytes (one tp=1 shard of every layer) and the devices' memory."""
    cfg, dtype = model.cfg, DType.parse(options.dtype)
    parts = weight_parts(cfg, 1, 0)
    held = [parts.layer] * cfg.num_layers + [parts.embedding, parts.head]
    weights = {q.value: sum(part.nbytes(dtype, q) for part in held) for q in Quantization}
    budget = sum(max(0, d.memory - options.reserve) for d in devices)
    less = f" less {compact_bytes(options.reserve)} reserve each" if options.reserve else ""
    spec = describe_devices(devices) + less
    return Totals(sum(part.total for part in held), weights, spec, budget)


def fitted(p: Plan) -> str:
    """A fitting plan's numbers, checkable by hand: its layout, and its tightest device's peak as weights + KV
    cache + everything else against that device's memory (less the reserve)."""
    sh = min(p.shards, key=lambda s: s.headroom)
    m, reserve = sh.memory, p.options.reserve
    less = f" less the {compact_bytes(reserve)} reserve" if reserve else ""
    budget = f"{gb(sh.device.memory - reserve)} ({compact_bytes(sh.device.memory)}{less})"
    per = "per device" if p.pp == 1 and len({s.memory.total for s in p.shards}) == 1 else "tightest device"
    return (f"tp={p.tp} × pp={p.pp} on {len(p.shards)} devices; {per}: weights {gb(m.weights)} + KV cache "
            f"{gb(m.kv_cache)} + other {gb(m.other)} = {gb(m.total)} of {budget}")  # fmt: skip


def _largest_fitting(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """The largest n in [lo, hi] with fits(n), assuming fits is monotone (true up to some n); None if none."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _more_devices(model: ModelInfo, devices: tuple[Device, ...], options: PlanOptions) -> Suggestion | None:
    """The fewest extra devices of the largest size given, on one new node, that make it fit (with the
    options' dtype and quantization)."""
    size = max(d.memory for d in devices)
    speed = max(d.speed for d in devices if d.memory == size)
    node = "extra" if "extra" not in nodes_of(devices) else "extra2"

    def with_extra(k: int) -> tuple[Device, ...]:
        return devices + tuple(Device(node, i, size, speed) for i in range(k))

    planned: dict[int, Plan | None] = {}  # each device count planned once: the search revisits its bounds

    def extra(k: int) -> Plan | None:
        if k not in planned:
            planned[k] = _try(model, with_extra(k), options)
        return planned[k]

    limit = 4 * model.cfg.num_layers  # more than a few devices per layer is never the answer
    k = 1
    while k < limit and extra(k) is None:
        k *= 2
    k = min(k, limit)
    if extra(k) is None:
        return None
    # The smallest j in (k/2, k] that fits: k/2 did not (or k is 1), so bisect on "does not fit".
    fewest = max(1, 1 + (_largest_fitting(k // 2, k - 1, lambda j: extra(j) is None) or 0))
    spec = describe_devices(with_extra(fewest))
    chosen = extra(fewest)
    assert chosen is not None
    int8 = options.quantization == Quantization.INT8.value
    changes: dict[str, object] = {"devices": spec, **({"quantization": Quantization.INT8.value} if int8 else {})}
    how, flag = (" with --quantize int8", " --quantize int8") if int8 else (f" in {options.dtype}", "")
    return Suggestion(f"{fewest} more {compact_bytes(size)} device{'s' * (fewest > 1)}{how} (--devices {spec}{flag}): "
                      f"{fitted(chosen)}", changes, chosen)  # fmt: skip


def offload(model: ModelInfo, devices: tuple[Device, ...], options: PlanOptions) -> OffloadProposal | None:
    """Offload on these devices in the options' dtype and quantization (`offload.propose` for every tensor degree): the
    layout whose predicted step is shortest (without rates: that waits for the fewest streamed bytes); None when no
    layout holds every shard even with all its layers streamed."""
    proposals = [p for tp in _degrees(model, devices, options)
                 if (groups := _stage_groups(model, devices, tp, options))
                 and (p := propose(model, groups, tp, options)) is not None]  # fmt: skip
    return min(proposals, key=OffloadProposal.rank_key, default=None)


def suggest(model: ModelInfo, devices: tuple[Device, ...], options: PlanOptions) -> list[Suggestion]:
    """Single changes that make the model fit, each checked by planning again: int8 on the same devices first,
    then another dtype, more devices (in the serving dtype, and with int8 when the same devices are not
    enough for it), offload on the same devices, a shorter context, fewer KV slots."""
    out: list[Suggestion] = []
    lim = options.limits
    int8 = replace(options, quantization=Quantization.INT8.value)
    int8_here = None if options.quantization == int8.quantization else _try(model, devices, int8)
    if int8_here is not None:
        out.append(Suggestion(f"--quantize int8 on the same devices: {fitted(int8_here)}",
                              {"quantization": Quantization.INT8.value}, int8_here))  # fmt: skip
    for dtype in (DType.BFLOAT16, DType.FLOAT16):
        smaller = dtype.itemsize < DType(options.dtype).itemsize
        if smaller and (p := _try(model, devices, replace(options, dtype=dtype))) is not None:
            out.append(Suggestion(f"--dtype {dtype} instead of {options.dtype} (half the bytes per weight and per "
                                  f"KV entry): {fitted(p)}", {"dtype": dtype.value}, p))  # fmt: skip
            break
    more = _more_devices(model, devices, options)
    if more is not None:
        out.append(more)
    int8_short = options.quantization != int8.quantization and int8_here is None  # int8 alone does not fit here
    if int8_short:
        more_int8 = _more_devices(model, devices, int8)
        if more_int8 is not None:
            out.append(more_int8)
    # Offload in the options' quantization, then, where int8 alone does not fit these devices, int8 and offload
    # together: a quarter (or half) of the bytes streamed.
    for opts in (options, int8) if int8_short else (options,):
        streamed = offload(model, devices, opts)
        if streamed is not None:
            changes = {"quantization": Quantization.INT8.value} if opts is int8 else {}
            out.append(Suggestion("\n    ".join(streamed.describe()), {**changes, "memory_budget": streamed.budget},
                                  offload=streamed))  # fmt: skip

    def with_context(n: int) -> PlanOptions:
        return replace(options, limits=ServingLimits(lim.kv_slots, n, min(lim.max_batch_tokens, n)))

    ctx = _largest_fitting(1, lim.max_context - 1, lambda n: _fits(model, devices, with_context(n)))
    if ctx is not None:
        out.append(Suggestion(f"--max-context {ctx} instead of {lim.max_context} (a shorter KV cache per slot)",
                              {"max_context": ctx, "max_batch_tokens": min(lim.max_batch_tokens, ctx)}))  # fmt: skip
    slots = _largest_fitting(
        1, lim.kv_slots - 1, lambda n: _fits(model, devices, replace(options, limits=replace(lim, kv_slots=n)))
    )
    if slots is not None:
        out.append(Suggestion(f"--kv-slots {slots} instead of {lim.kv_slots} (fewer sequences in flight)",
                              {"kv_slots": slots}))  # fmt: skip
    return out
