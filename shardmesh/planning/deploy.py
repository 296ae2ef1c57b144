"""From a validated manifest to what runs: the plan (when nodes are listed) and the services' flags.

`resolve` turns a `Manifest` into a `Deployment` (pp, tp, dtype, limits, and the plan behind them);
`up_args` maps that onto the flags `shardmesh up` already takes, so a manifest deploys exactly what
the equivalent command line would; `service_commands` prints those command lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shardmesh.core.device_map import assign_devices
from shardmesh.core.dtypes import DType
from shardmesh.core.heads import valid_tp_degrees
from shardmesh.core.layout import format_split, layer_counts, split_layers
from shardmesh.core.topology import ServingLimits
from shardmesh.models import hub
from shardmesh.planning.devices import Device, make_devices
from shardmesh.planning.kv_blocks import paged_limits, placement_block_bytes
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
    base_dir: Path | None = None  # the manifest's directory: relative file paths in it are read from there

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

    def path(self, value: str) -> Path:
        """A file path the manifest names, relative to its own directory unless absolute."""
        raw = Path(value).expanduser()
        return raw if raw.is_absolute() or self.base_dir is None else self.base_dir / raw

    def worker_devices(self) -> list[str]:
        """Each global rank's `--device`: with `services.worker.device: cuda` and a plan, the GPU of the plan's
        shard, by its index within its node (each node starts at cuda:0); without a plan, cuda:RANK. cpu and
        cuda:N (one rank only, checked by `resolve`) as written."""
        spec = self.manifest.services.worker.device
        if spec == "cuda" and self.plan is not None:
            return [f"cuda:{shard.device.index}" for shard in self.plan.shards]
        # The commands run on hosts of their own: the GPU count there is not ours to check, only the ranks'.
        return assign_devices(spec, self.pp, self.tp, visible_gpus=None, flag="services.worker.device")

    def up_device(self) -> str:
        """`up --device` for this deployment on one host: the plan's GPUs when it places every rank on one node;
        a plan over several nodes would put ranks of different nodes on the same cuda:N here, so there every rank
        takes a GPU of its own in rank order (`cuda`)."""
        spec = self.manifest.services.worker.device
        if spec == "cuda" and self.plan is not None and len({sh.device.node for sh in self.plan.shards}) == 1:
            return ",".join(self.worker_devices())
        return spec

    def rank_nodes_flag(self) -> str | None:
        """`--rank-nodes`: the node the plan put each global rank on, e.g. "a,a,b"; None without a plan."""
        if self.plan is None:
            return None
        return ",".join(self.node_of(r) or "" for r in range(self.pp * self.tp))

    def tp_split_flag(self) -> str | None:
        """`--tp-split`: each tensor-parallel rank's share (`parallelism.tensor_split.shares`); None for even ones."""
        from shardmesh.core.heads import format_tp_split

        return format_tp_split(tuple(self.manifest.parallelism.tensor_split.shares)) or None


def check_shares(m: Manifest, model: ModelInfo, tp: int, source: str) -> None:
    """`parallelism.tensor_split.shares` fits `tp` and the model (`heads.check_tp_split`), else a ManifestError."""
    from shardmesh.core.heads import TensorParallelError, check_tp_split

    shares = tuple(m.parallelism.tensor_split.shares)
    if shares and m.parallelism.tensor == "auto":
        raise ManifestError(source, ["parallelism.tensor_split.shares: needs an integer parallelism.tensor (one "
                                     "share per rank), not 'auto'"])  # fmt: skip
    try:
        check_tp_split(model.cfg, tp, shares)
    except TensorParallelError as e:
        raise ManifestError(source, [f"parallelism.tensor_split.shares: {e}"]) from None


def check_device(m: Manifest, pp: int, tp: int, source: str) -> None:
    """`services.worker.device` for pp × tp ranks: cuda:N names one GPU, for one rank only."""
    spec = m.services.worker.device
    try:
        assign_devices(spec, pp, tp, visible_gpus=None, flag="services.worker.device")
    except ValueError as e:
        raise ManifestError(source, [str(e)]) from None


def model_dir(m: Manifest, source: Path | None, resolve_name: bool = True) -> Path:
    """`model.path` (and `model.revision`): a directory (relative to the manifest's own directory), else a known
    model name or a Hugging Face id, resolved as every command resolves `--model` (`registry.resolve`)."""
    src = str(source or "manifest")
    raw = Path(m.model.path).expanduser()
    if m.model.revision is None:
        if not raw.is_absolute() and source is not None and (source.parent / raw).is_dir():
            return source.parent / raw
        if raw.is_dir():
            return raw
    if not resolve_name:
        raise ManifestError(src, [f"model.path: {m.model.path!r} is not a directory (relative paths are read from "
                                  f"the manifest's directory)"])  # fmt: skip
    from shardmesh.models.registry import RevisionError, UnknownModelError, resolve

    try:
        return resolve(m.model.path, revision=m.model.revision)
    except RevisionError as e:
        raise ManifestError(src, [f"model.revision: {e}"]) from None
    except UnknownModelError as e:
        raise ManifestError(src, [f"model.path: {e}"]) from None


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
        dtype=m.model.dtype, quantization=m.model.quantization, limits=limits(m, model, source), runtime=runtime,
        tp=None if par.tensor == "auto" else par.tensor, pp=None if par.pipeline == "auto" else par.pipeline,
        balance=p.balance, node_order=tuple(p.node_order), reserve=p.reserve,
        tp_split=tuple(par.tensor_split.shares),
    )  # fmt: skip


def resolve(m: Manifest, source: Path | None = None, model: ModelInfo | None = None) -> Deployment:
    """Plan the manifest's deployment. ManifestError for fields that do not fit the model; `Infeasible`
    (a PlanError) when the nodes cannot hold it."""
    src = str(source or "manifest")
    base_dir = source.parent if source is not None else None
    if model is None:
        path = model_dir(m, source)
        model = load_model(path)
        if model.name == path.name:  # config.json has no `_name_or_path`: a hub snapshot is named by its id
            model = dataclasses.replace(model, name=hub.model_name(path))
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
        check_device(m, par.pipeline, par.tensor, src)
        check_shares(m, model, par.tensor, src)
        lim = paged(m, model, par.tensor, split_layers(model.cfg.num_layers, par.pipeline), opts.limits, src)
        return Deployment(m, model, par.pipeline, par.tensor, lim, None, base_dir=base_dir)
    try:
        chosen = plan(model, devices(m), opts)
    except PlanError as e:
        if type(e) is PlanError:  # a request that cannot be tried: name the manifest fields
            raise ManifestError(src, [f"parallelism: {e}"]) from None
        raise
    check_device(m, chosen.pp, chosen.tp, src)
    check_shares(m, model, chosen.tp, src)
    notes = []
    if not chosen.even_split:
        basis = "free memory" if opts.balance == "memory" else "speed"
        notes.append(f"uneven layer split {layer_counts(chosen.layer_split)} (layers per stage), in "
                     f"proportion to each stage's {basis}")  # fmt: skip
    lim = paged(m, model, chosen.tp, chosen.layer_split, opts.limits, src)
    return Deployment(m, model, chosen.pp, chosen.tp, lim, chosen, notes, base_dir=base_dir)


def paged(m: Manifest, model: ModelInfo, tp: int, split: Sequence[tuple[int, int]], slots: ServingLimits,
          source: str) -> ServingLimits:  # fmt: skip
    """`slots`, or with `serving.kv_block_size` the paged cache's limits: the blocks `serving.kv_cache_memory` buys
    on the most loaded shard of the placement, as the coordinator computes them from the same flags."""
    s = m.serving
    if not s.kv_block_size:
        return slots
    per_block = placement_block_bytes(model.cfg, split, tp, s.kv_block_size, DType.parse(m.model.dtype).itemsize)
    try:
        return paged_limits(slots, s.kv_block_size, per_block, s.kv_cache_memory)
    except ValueError as e:
        raise ManifestError(source, [f"serving.{e}"]) from None


def up_args(d: Deployment, base: argparse.Namespace) -> argparse.Namespace:
    """`base` (the `up` command's own flags: log dir, timeouts, demo) with everything the manifest sets."""
    m = d.manifest
    out = argparse.Namespace(**vars(base))
    out.model = str(d.model.path)
    out.pp, out.tp, out.dtype = d.pp, d.tp, d.dtype
    out.quantize = m.model.quantization
    out.device = d.up_device()
    out.memory_budget = str(m.services.worker.memory_budget) if m.services.worker.memory_budget is not None else None
    gateway, coordinator = m.services.gateway.listen, m.services.coordinator.listen
    out.listen = gateway if address_port(gateway) else None  # port 0: `up` picks a free one
    out.kv_slots = d.limits.kv_slots
    out.max_context = d.limits.max_context
    out.max_batch_tokens = d.limits.max_batch_tokens
    out.kv_block_size = d.limits.kv_block_size
    out.kv_cache_memory = str(m.serving.kv_cache_memory) if m.serving.kv_cache_memory is not None else None
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
    if (tp_split := d.tp_split_flag()) is not None:
        out.tp_split = tp_split
    sec = m.services.security
    if sec.tls_dir:  # `up --tls` with the manifest's material (made there when missing)
        out.tls, out.tls_dir = True, str(d.path(sec.tls_dir))
    if sec.join_token_file:
        out.join_token_file = str(d.path(sec.join_token_file))
    if sec.api_key_file:
        out.api_key_file = str(d.path(sec.api_key_file))
    return out


def security_flags(d: Deployment, service: str) -> list[str]:
    """`services.security` as `service`'s flags (coordinator, worker or gateway): its certificate of `tls_dir`, the
    `--join-token-file`, and for the gateway the `--api-key-file`."""
    sec, flags = d.manifest.services.security, []
    if sec.tls_dir:
        directory = d.path(sec.tls_dir)
        flags += ["--tls-cert", str(directory / f"{service}.pem"), "--tls-key", str(directory / f"{service}.key"),
                  "--tls-ca", str(directory / "ca.pem")]  # fmt: skip
    if sec.join_token_file:
        flags += ["--join-token-file", str(d.path(sec.join_token_file))]
    if sec.api_key_file and service == "gateway":
        flags += ["--api-key-file", str(d.path(sec.api_key_file))]
    return flags


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
             "--tp", str(d.tp), "--dtype", d.dtype, "--kv-slots", str(lim.kv_slots),
             "--max-context",
             str(lim.max_context), "--max-batch-tokens", str(lim.max_batch_tokens), "--store-port",
             str(m.services.coordinator.store_port), "--max-stage-ratio", f"{p.max_stage_ratio:g}",
             "--rebalance", p.rebalance]  # fmt: skip
    if m.model.quantization != "none":
        flags += ["--quantize", m.model.quantization]
    if lim.paged:
        flags += ["--kv-block-size", str(lim.kv_block_size)]
    if lim.paged and m.serving.kv_cache_memory is not None:
        flags += ["--kv-cache-memory", str(m.serving.kv_cache_memory)]
    if p.require_balance:
        flags.append("--require-balance")
    layers, nodes = d.layers_flag(), d.rank_nodes_flag()
    flags += ["--layers", layers] if layers else []
    flags += ["--rank-nodes", nodes] if nodes else []
    tp_split = d.tp_split_flag()
    flags += ["--tp-split", tp_split] if tp_split else []
    return flags + _telemetry(m) + security_flags(d, "coordinator")


def service_commands(d: Deployment) -> list[str]:
    """The command line of every service the deployment runs (what compose or `up` would start)."""
    m, coord = d.manifest, d.manifest.services.coordinator.listen
    if not address_port(coord):  # port 0: the coordinator picks one and logs it; the others need that one
        coord = f"{coord.rpartition(':')[0]}:COORDINATOR_PORT"
    coordinator = ["shardmesh", "coordinator", *coordinator_flags(d)]
    lines = [shlex.join(coordinator)]
    shards = d.plan.shards if d.plan is not None else ()
    devices = d.worker_devices()
    for rank in range(d.pp * d.tp):
        worker = ["shardmesh", "worker", "--coordinator", coord, "--worker-id", f"worker-{rank}", "--device",
                  devices[rank], *_telemetry(m), *security_flags(d, "worker")]  # fmt: skip
        if m.services.worker.memory_budget is not None:
            worker += ["--memory-budget", str(m.services.worker.memory_budget)]
        if shards:
            node = next(n for n in m.nodes if n.name == shards[rank].device.node)
            labels = sorted({"node": node.name, **node.labels}.items())
            worker += [a for k, v in labels for a in ("--label", f"{k}={v}")]
        lines.append(shlex.join(worker))
    gateway = ["shardmesh", "gateway", "--listen", m.services.gateway.listen, "--coordinator", coord,
               "--max-queue", str(m.serving.max_queue), *gateway_http_flags(d), *_telemetry(m),
               *security_flags(d, "gateway")]  # fmt: skip
    lines.append(shlex.join(gateway))
    return lines


def served_model_name(d: Deployment) -> str:
    """The model's name for clients: `model.served_model_name`, else `model.path` as written (as `up --manifest`
    names it)."""
    return d.manifest.model.served_model_name or d.manifest.model.path


def gateway_http_flags(d: Deployment) -> list[str]:
    """The gateway's OpenAI-compatible API as the manifest sets it (`services.gateway.http_listen`; null: none),
    and its model name where it differs from what the coordinator publishes (its `--model`, a directory)."""
    listen = d.manifest.services.gateway.http_listen
    flags = ["--http-listen", listen] if listen is not None else []
    served = served_model_name(d)
    return flags + (["--served-model-name", served] if served != str(d.model.path) else [])
