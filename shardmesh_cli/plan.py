"""`shardmesh plan`: how a model splits over given devices, or what a manifest will deploy.

Exit codes: 0 a plan that fits; 1 it does not fit (the message says what is missing and what would
fit); 2 bad input (a flag, a manifest field: one line per problem, no traceback).
When nothing fits, offload's step time comes from `--link-bandwidth` (and `--memory-bandwidth`) when given, and
for cpu workers otherwise from a short probe of this host (`shardmesh.planning.link`, about 2 s), run only then.
Imports only the standard library (and the dtype names) at import time, so building the `shardmesh`
parser stays cheap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from shardmesh.core.dtypes import QUANTIZE_HELP, DType, Quantization
from shardmesh.models.hub import MODEL_HELP, REVISION_HELP
from shardmesh.rpc.flags import EXIT_USAGE, UsageError

if TYPE_CHECKING:
    from shardmesh.planning.deploy import Deployment
    from shardmesh.planning.devices import Device
    from shardmesh.planning.memory import ModelInfo
    from shardmesh.planning.offload import LinkRates
    from shardmesh.planning.planner import Plan, PlanOptions

EXIT_INFEASIBLE = 1  # a usage error exits EXIT_USAGE (2)
# Flags a manifest sets itself; giving them as well is refused rather than silently overridden.
MANIFEST_FIELDS = {
    "model": "model.path", "devices": "nodes", "dtype": "model.dtype", "kv_slots": "serving.kv_slots",
    "max_context": "serving.max_context", "max_batch_tokens": "serving.max_batch_tokens",
    "tp": "parallelism.tensor", "pp": "parallelism.pipeline", "balance": "placement.balance",
    "reserve": "placement.reserve", "runtime_overhead": "placement.runtime_overhead",
    "device": "services.worker.device", "revision": "model.revision", "quantize": "model.quantization",
    "kv_block_size": "serving.kv_block_size", "kv_cache_memory": "serving.kv_cache_memory",
}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"{MODEL_HELP}; a directory needs only config.json: no weight is read")
    p.add_argument("--revision", help=REVISION_HELP)
    p.add_argument("--devices", help="devices as [NODE:]COUNTxSIZE[@SPEED],...: 4x24GiB or nodeA:2x80GiB,nodeB:1x48GiB")
    p.add_argument("--manifest", metavar="FILE", help="plan the deployment a YAML manifest describes")
    p.add_argument(
        "--dtype", choices=DType.names(), help="serving dtype (default float32, as `up` and the coordinator)"
    )
    p.add_argument("--quantize", choices=Quantization.names(), help=f"{QUANTIZE_HELP}; when nothing fits, the "
                   "proposals say whether int8 would")  # fmt: skip
    p.add_argument("--kv-slots", type=int, help="KV-cache slots per shard (default 8); with --kv-block-size, the "
                   "most sequences in flight")  # fmt: skip
    p.add_argument("--kv-block-size", type=int, help="plan a paged KV cache of blocks of this many tokens, e.g. "
                   "16: as many blocks as every device has room for (or --kv-cache-memory buys)")  # fmt: skip
    p.add_argument("--kv-cache-memory", metavar="SIZE", help="with --kv-block-size: bytes per shard for the paged KV "
                   "cache, as the coordinator's flag (default: the room the devices have left)")  # fmt: skip
    p.add_argument("--max-context", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--max-batch-tokens", type=int, help="tokens per step (default: --max-context)")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default: choose)")
    p.add_argument("--pp", type=int, help="pipeline stages (default: choose)")
    p.add_argument("--balance", choices=("memory", "speed"), help="split layers by free memory (default) or speed")
    p.add_argument("--reserve", help="memory every device keeps free, e.g. 2GiB (default 0)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="what the workers run on: cpu plans host memory "
                   "(default), cuda plans device memory")  # fmt: skip
    p.add_argument("--runtime-overhead", help="fixed bytes per worker process (default: the CPU measurement, or "
                   "1GiB for a CUDA context)")  # fmt: skip
    p.add_argument("--link-bandwidth", metavar="RATE", help="when nothing fits, the rate streamed weights reach a "
                   "device, e.g. 25GB/s (host to device for cuda), for offload's step time (default for cpu: measured "
                   "on this host; for cuda: no step time)")  # fmt: skip
    p.add_argument("--memory-bandwidth", metavar="RATE", help="the rate a device reads its resident weights, e.g. "
                   "3TB/s, added to offload's step time (default for cpu: measured with the link; for cuda: not "
                   "counted)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--manifest-schema", action="store_true", help="print the manifest's JSON Schema and exit")


def _flag_options(args: argparse.Namespace) -> tuple[ModelInfo, tuple[Device, ...], PlanOptions]:
    from shardmesh.core.step import blocks_for
    from shardmesh.core.topology import ServingLimits
    from shardmesh.core.units import parse_bytes
    from shardmesh.models import hub
    from shardmesh.models.registry import RevisionError, resolve
    from shardmesh.planning.devices import parse_devices
    from shardmesh.planning.memory import RuntimeCosts, load_model
    from shardmesh.planning.planner import PlanOptions

    if not args.model or not args.devices:
        raise UsageError("give --model DIR and --devices SPEC, or --manifest FILE")
    try:
        devices = parse_devices(args.devices)
        reserve = parse_bytes(args.reserve) if args.reserve else 0
        overhead = parse_bytes(args.runtime_overhead) if args.runtime_overhead else None
        runtime = RuntimeCosts.for_device(args.device or "cpu", overhead)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        path = resolve(args.model, revision=args.revision)
        model = load_model(path)
    except RevisionError as e:
        raise UsageError(f"--revision: {e}") from None
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"--model: {e}") from None
    if model.name == path.name:  # config.json has no `_name_or_path`: name it as `--model` did (not by a commit id)
        model = dataclasses.replace(model, name=hub.model_name(path))
    ctx = args.max_context if args.max_context is not None else model.cfg.max_context
    if not 1 <= ctx <= model.cfg.max_context:
        raise UsageError(f"--max-context: must be in 1..{model.cfg.max_context} (the model's context), got {ctx}")
    for flag, value in (("--kv-slots", args.kv_slots), ("--max-batch-tokens", args.max_batch_tokens),
                        ("--tp", args.tp), ("--pp", args.pp)):  # fmt: skip
        if value is not None and value < 1:
            raise UsageError(f"{flag}: must be >= 1, got {value}")
    limits = ServingLimits(args.kv_slots or 8, ctx, args.max_batch_tokens or ctx)
    if args.kv_cache_memory and not args.kv_block_size:
        raise UsageError("--kv-cache-memory: sizes a paged KV cache, give --kv-block-size too")
    if args.kv_block_size is not None:
        if args.kv_block_size < 1:
            raise UsageError(f"--kv-block-size: must be >= 1, got {args.kv_block_size}")
        # Planned first with the blocks of one whole sequence (what must fit at least); `_paged` sizes them after.
        blocks = blocks_for(ctx, args.kv_block_size)
        limits = ServingLimits(limits.kv_slots, ctx, limits.max_batch_tokens, args.kv_block_size, blocks)
    opts = PlanOptions(dtype=args.dtype or DType.FLOAT32, quantization=args.quantize or Quantization.NONE.value,
                       limits=limits, runtime=runtime, tp=args.tp, pp=args.pp, balance=args.balance or "memory",
                       reserve=reserve, rates=_given_rates(args, runtime.device))  # fmt: skip
    return model, devices, opts


def _given_rates(args: argparse.Namespace, device: str) -> LinkRates | None:
    """The rates the flags give (None: none given, or only a memory rate for cpu, where the link is measured)."""
    from shardmesh.planning.link import parse_rate
    from shardmesh.planning.offload import LinkRates, Rate

    try:
        link = parse_rate(args.link_bandwidth, "--link-bandwidth") if args.link_bandwidth else None
        memory = parse_rate(args.memory_bandwidth, "--memory-bandwidth") if args.memory_bandwidth else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if link is None:
        if memory is not None and device != "cpu":
            raise UsageError("--memory-bandwidth: give --link-bandwidth too (the link of a cuda device is not "
                             "measured here)")  # fmt: skip
        return None
    return LinkRates(Rate(link, "given: --link-bandwidth"),
                     Rate(memory, "given: --memory-bandwidth") if memory is not None else None)  # fmt: skip


def _plan(args: argparse.Namespace, model: ModelInfo, devices: tuple[Device, ...], opts: PlanOptions) -> Plan:
    """`_plan_layout`, and for a paged KV cache the blocks sized: as many as `--kv-cache-memory` buys on the most
    loaded shard, or as every device has room for (`planner.fill_kv_blocks`), then planned again with them."""
    from shardmesh.core.units import parse_bytes
    from shardmesh.planning.kv_blocks import paged_limits, placement_block_bytes
    from shardmesh.planning.planner import fill_kv_blocks

    p = _plan_layout(args, model, devices, opts)
    lim = opts.limits
    if not lim.kv_block_size:
        return p
    if args.kv_cache_memory:
        try:
            memory = parse_bytes(args.kv_cache_memory)
            per_block = placement_block_bytes(model.cfg, p.layer_split, p.tp, lim.kv_block_size,
                                              DType.parse(opts.dtype).itemsize)  # fmt: skip
            lim = paged_limits(lim, lim.kv_block_size, per_block, memory)
        except ValueError as e:
            raise UsageError(f"--kv-cache-memory: {str(e).removeprefix('kv_cache_memory: ')}") from None
    else:
        lim = dataclasses.replace(lim, kv_blocks=fill_kv_blocks(p, lim.kv_block_size))
    return _plan_layout(args, model, devices, dataclasses.replace(opts, limits=lim, tp=p.tp, pp=p.pp))


def _plan_layout(args: argparse.Namespace, model: ModelInfo, devices: tuple[Device, ...], opts: PlanOptions) -> Plan:
    """`planner.plan`; when it proposes offload for cpu workers, plan again with what this host says: the unit its
    mappings fault in (`engine.offload.map_unit`), and the rates, measured when not given (the planner stays pure:
    it gets numbers, and the probe runs only when offload is proposed)."""
    from shardmesh.planning.planner import Infeasible, plan

    try:
        return plan(model, devices, opts)
    except Infeasible as e:
        if opts.runtime.device != "cpu" or not any(s.offload for s in e.suggestions):
            raise
    return plan(model, devices, _host_options(args, opts))


def _host_options(args: argparse.Namespace, opts: PlanOptions) -> PlanOptions:
    from shardmesh.engine.offload import map_unit  # imports torch: only on the way to an offload proposal
    from shardmesh.planning.link import measure, parse_rate
    from shardmesh.planning.offload import Rate

    opts = dataclasses.replace(opts, map_unit=map_unit())
    if opts.rates is not None:  # --link-bandwidth given: no probe
        return opts
    rates = measure()
    if args.memory_bandwidth:  # given wins over measured (validated by `_given_rates`)
        given = Rate(parse_rate(args.memory_bandwidth, "--memory-bandwidth"), "given: --memory-bandwidth")
        rates = dataclasses.replace(rates, memory=given)
    return dataclasses.replace(opts, rates=rates)


def run(args: argparse.Namespace) -> int:
    from shardmesh.planning import deploy, report
    from shardmesh.planning.manifest import ManifestError, load_manifest, schema_text
    from shardmesh.planning.planner import Infeasible, PlanError

    if args.manifest_schema:
        sys.stdout.write(schema_text())
        return 0
    try:
        if args.manifest:
            given = [k for k in MANIFEST_FIELDS if getattr(args, k) is not None]
            if given:
                raise UsageError("; ".join(f"--{k.replace('_', '-')}: the manifest sets this ({MANIFEST_FIELDS[k]})"
                                       for k in given))  # fmt: skip
            source = Path(args.manifest)
            d = deploy.resolve(load_manifest(source), source)
            return _print_deployment(d, args.json)
        model, devices, opts = _flag_options(args)
        chosen = _plan(args, model, devices, opts)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ManifestError as e:
        for line in e.errors:
            print(f"error: {e.source}: {line}", file=sys.stderr)
        return EXIT_USAGE
    except Infeasible as e:
        if args.json:
            print(json.dumps(report.infeasible_to_json(e)))
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(report.plan_to_json(chosen)) if args.json else report.render_table(chosen))
    return 0


def _print_deployment(d: Deployment, as_json: bool) -> int:
    from shardmesh.planning import deploy, report

    commands = deploy.service_commands(d)
    if as_json:
        out = {"pp": d.pp, "tp": d.tp, "dtype": d.dtype, "plan": report.plan_to_json(d.plan) if d.plan else None,
               "notes": d.notes, "commands": commands}  # fmt: skip
        print(json.dumps(out))
        return 0
    if d.plan is not None:
        print(report.render_table(d.plan))
    else:
        print(f"model: {d.model.name}; pp={d.pp} × tp={d.tp}, {d.dtype} (no nodes listed: nothing to place)")
    for n in d.notes:
        print(f"note: {n}")
    if any("COORDINATOR_PORT" in c for c in commands):
        print(
            "note: services.coordinator.listen has port 0: the coordinator picks a free port and logs it "
            "(`listening`); give that port to the workers and the gateway, or set a fixed one"
        )
    print("\nservices (`shardmesh up --manifest FILE` starts them as local processes):")
    for c in commands:
        print(f"  {c}")
    return 0
