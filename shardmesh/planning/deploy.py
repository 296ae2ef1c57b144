"""From a validated manifest to what runs: the plan (when nodes are listed) and the services' flags.

`resolve` turns a `Manifest` into a `Deployment` (pp, tp, dtype, limits, and the plan behind them);
`up_args` maps that onto the flags `shardmesh up` already takes, so a manifest deploys exactly what
the equivalent command line would; `service_commands` prints those command lines.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from shardmesh.core.heads import valid_tp_degrees
from shardmesh.core.layout import format_split, layer_counts
from shardmesh.core.topology import ServingLimits
from shardmesh.planning.devices import Device, make_devices
from shardmesh.planning.manifest import Manifest, ManifestError, address_port
from shardmesh.planning.memory import ModelInfo, RuntimeCosts, load_model
from shardmesh.planning.planner import Plan, PlanError, PlanOptions, plan


@dataclass(frozen=True)
class Deployment:
    manifest: Manifest
    model: ModelInfo
    pp: int
    tp: int
    limits: ServingLimits
    plan: Plan | None  # None when the manifest lists no nodes (fixed pp and tp, nothing to place)
    notes: list[str] = field(default_factory=list)

    @property
    def dtype(self) -> str:
        return self.manifest.model.dtype

    def node_of(self, rank: int) -> str | None:
        """The node the plan puts global rank `rank` on; None without a plan."""
        return self.plan.shards[rank].device.node if self.plan is not None else None

    def layers_flag(self) -> str | None:
        """`--layers` for the coordinator when the plan splits layers unevenly: counts per stage, e.g. "18,12";
        None for the coordinator's own even split."""
        if self.plan is None or self.plan.even_split:
            return None
        return format_split(self.plan.layer_split)

    def rank_nodes_flag(self) -> str | None:
        """`--rank-nodes`: the node the plan put each global rank on, e.g. "a,a,b"; None without a plan."""
        if self.plan is None:
            return None
        return ",".join(self.node_of(r) or "" for r in range(self.pp * self.tp))


def model_dir(m: Manifest, source: Path | None, resolve_name: bool = True) -> Path:
    """`model.path`: a directory (relative to the manifest's own directory), else a known model name."""
    raw = Path(m.model.path).expanduser()
    if not raw.is_absolute() and source is not None and (source.parent / raw).is_dir():
        return source.parent / raw
    if raw.is_dir():
        return raw
    if resolve_name:
        from shardmesh.models.registry import REGISTRY, resolve

        if m.model.path in REGISTRY:
            return resolve(m.model.path)
    raise ManifestError(str(source or "manifest"), [f"model.path: {m.model.path!r} is neither a directory (relative "
                                                     f"paths are read from the manifest's directory) nor a known "
                                                     f"model name"])  # fmt: skip


def devices(m: Manifest) -> tuple[Device, ...]:
    return make_devices([(n.name, g.count, g.memory, g.speed) for n in m.nodes for g in n.devices])


def limits(m: Manifest, model: ModelInfo, source: str) -> ServingLimits:
    s, ctx = m.serving, model.cfg.max_context
    if s.max_context is not None and s.max_context > ctx:
        raise ManifestError(source, [f"serving.max_context: must be <= {ctx} (the model's context), got "
                                     f"{s.max_context}"])  # fmt: skip
    max_context = s.max_context or ctx
    return ServingLimits(s.kv_slots, max_context, s.max_batch_tokens or max_context)


def options(m: Manifest, model: ModelInfo, source: str) -> PlanOptions:
    p, par = m.placement, m.parallelism
    runtime = RuntimeCosts.for_device(m.services.worker.device, p.runtime_overhead)
    return PlanOptions(
        dtype=m.model.dtype, limits=limits(m, model, source), runtime=runtime,
        tp=None if par.tensor == "auto" else par.tensor, pp=None if par.pipeline == "auto" else par.pipeline,
        balance=p.balance, node_order=tuple(p.node_order), reserve=p.reserve,
    )  # fmt: skip


def resolve(m: Manifest, source: Path | None = None, model: ModelInfo | None = None) -> Deployment:
    """Plan the manifest's deployment. ManifestError for fields that do not fit the model; `Infeasible`
    (a PlanError) when the nodes cannot hold it."""
    src = str(source or "manifest")
    model = model or load_model(model_dir(m, source))
    opts = options(m, model, src)
    par = m.parallelism
    if not m.nodes:
        auto = [f"parallelism.{k}" for k, v in (("tensor", par.tensor), ("pipeline", par.pipeline)) if v == "auto"]
        if auto:
            raise ManifestError(src, [f"{a}: 'auto' needs nodes to plan on; list nodes, or give an integer"
                                      for a in auto])  # fmt: skip
        assert isinstance(par.tensor, int) and isinstance(par.pipeline, int)
        problems = []
        if par.tensor not in valid_tp_degrees(model.cfg):
            problems.append(f"parallelism.tensor: {par.tensor} is not valid for this model; valid: "
                            f"{valid_tp_degrees(model.cfg)}")  # fmt: skip
        if par.pipeline > model.cfg.num_layers:
            problems.append(f"parallelism.pipeline: must be <= {model.cfg.num_layers} (one layer per stage at "
                            f"least), got {par.pipeline}")  # fmt: skip
        if problems:
            raise ManifestError(src, problems)
        return Deployment(m, model, par.pipeline, par.tensor, opts.limits, None)
    try:
        chosen = plan(model, devices(m), opts)
    except PlanError as e:
        if type(e) is PlanError:  # a request that cannot be tried: name the manifest fields
            raise ManifestError(src, [f"parallelism: {e}"]) from None
        raise
    notes = []
    if not chosen.even_split:
        basis = "free memory" if opts.balance == "memory" else "speed"
        notes.append(f"uneven layer split {layer_counts(chosen.layer_split)} (layers per stage), in "
                     f"proportion to each stage's {basis}")  # fmt: skip
    return Deployment(m, model, chosen.pp, chosen.tp, opts.limits, chosen, notes)


def up_args(d: Deployment, base: argparse.Namespace) -> argparse.Namespace:
    """`base` (the `up` command's own flags: log dir, timeouts, demo) with everything the manifest sets."""
    m = d.manifest
    out = argparse.Namespace(**vars(base))
    out.model = str(d.model.path)
    out.pp, out.tp, out.dtype = d.pp, d.tp, d.dtype
    out.device = m.services.worker.device
    gateway, coordinator = m.services.gateway.listen, m.services.coordinator.listen
    out.listen = gateway if address_port(gateway) else None  # port 0: `up` picks a free one
    out.kv_slots = d.limits.kv_slots
    out.max_context = d.limits.max_context
    out.max_batch_tokens = d.limits.max_batch_tokens
    out.max_queue = m.serving.max_queue
    out.coordinator_listen = coordinator if address_port(coordinator) else None
    out.store_port = m.services.coordinator.store_port
    if m.telemetry.otlp_endpoint:  # otherwise `up`'s own --otlp-endpoint (or none) stands
        out.otlp_endpoint = m.telemetry.otlp_endpoint
    if m.telemetry.metrics_port:  # one host: `up` gives each service a free port instead of this one
        out.metrics = True
    pl = m.placement
    out.rebalance, out.max_stage_ratio, out.require_balance = pl.rebalance, pl.max_stage_ratio, pl.require_balance
    out.layers, out.rank_nodes = d.layers_flag(), d.rank_nodes_flag()
    return out


def _telemetry(m: Manifest) -> list[str]:
    """Every service exports to the same collector and serves metrics on the same port (its own host)."""
    t = m.telemetry
    flags = ["--otlp-endpoint", t.otlp_endpoint] if t.otlp_endpoint else []
    return flags + (["--metrics-port", str(t.metrics_port)] if t.metrics_port else [])


def coordinator_flags(d: Deployment) -> list[str]:
    """Everything the manifest tells the coordinator, as its flags (`coordinator --manifest` parses these
    very flags, so the file and the printed command line cannot drift apart)."""
    m, lim, p = d.manifest, d.limits, d.manifest.placement
    flags = ["--listen", m.services.coordinator.listen, "--model", str(d.model.path), "--pp", str(d.pp),
             "--tp", str(d.tp), "--dtype", d.dtype, "--kv-slots", str(lim.kv_slots), "--max-context",
             str(lim.max_context), "--max-batch-tokens", str(lim.max_batch_tokens), "--store-port",
             str(m.services.coordinator.store_port), "--max-stage-ratio", f"{p.max_stage_ratio:g}",
             "--rebalance", p.rebalance]  # fmt: skip
    if p.require_balance:
        flags.append("--require-balance")
    layers, nodes = d.layers_flag(), d.rank_nodes_flag()
    flags += ["--layers", layers] if layers else []
    flags += ["--rank-nodes", nodes] if nodes else []
    return flags + _telemetry(m)


def service_commands(d: Deployment) -> list[str]:
    """The command line of every service the deployment runs (what compose or `up` would start)."""
    m, coord = d.manifest, d.manifest.services.coordinator.listen
    coordinator = ["shardmesh", "coordinator", *coordinator_flags(d)]
    lines = [shlex.join(coordinator)]
    shards = d.plan.shards if d.plan is not None else ()
    for rank in range(d.pp * d.tp):
        worker = ["shardmesh", "worker", "--coordinator", coord, "--worker-id", f"worker-{rank}", "--device",
                  m.services.worker.device, *_telemetry(m)]  # fmt: skip
        if shards:
            node = next(n for n in m.nodes if n.name == shards[rank].device.node)
            labels = sorted({"node": node.name, **node.labels}.items())
            worker += [a for k, v in labels for a in ("--label", f"{k}={v}")]
        lines.append(shlex.join(worker))
    gateway = ["shardmesh", "gateway", "--listen", m.services.gateway.listen, "--coordinator", coord,
               "--max-queue", str(m.serving.max_queue), *_telemetry(m)]  # fmt: skip
    lines.append(shlex.join(gateway))
    return lines
