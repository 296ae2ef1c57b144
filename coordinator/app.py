"""`shardmesh coordinator`: flags (each also settable as SHARDMESH_COORDINATOR_<FLAG>), validation, run.

Everything that can be wrong with the configuration (an unreadable config.json, a pp or tp the model
cannot be split by) is found here, before anything listens, and reported as one line with exit
code 2. At import time this module reads only the pure library (core, flags, telemetry's flag names), so
building the `shardmesh` parser stays cheap; the service itself is imported when the command runs.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardmesh.core.dtypes import QUANTIZE_HELP, DType, Quantization
from shardmesh.core.layout import REBALANCES
from shardmesh.models.hub import MODEL_HELP, REVISION_HELP
from shardmesh.rpc import telemetry
from shardmesh.rpc.flags import JOIN_TOKEN_ENV, UsageError, add_tls_flags, env_flags, mesh_security

if TYPE_CHECKING:
    from shardmesh.core.config import ModelConfig
    from shardmesh.core.topology import ServingLimits

ENV_PREFIX = "SHARDMESH_COORDINATOR_"
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def add_arguments(p: argparse.ArgumentParser) -> None:
    flag = env_flags(p, ENV_PREFIX)
    flag("--listen", "127.0.0.1:50051", help="host:port for the gRPC server; port 0 picks a free one")
    flag(
        "--manifest",
        help="deployment manifest (YAML): sets every flag below that it covers, which may then not "
        "be given; see `shardmesh plan --manifest`",
    )
    flag("--model", help=f"{MODEL_HELP}; config.json is read here, the workers load the weights from the directory "
         "it resolves to; or --manifest")  # fmt: skip
    flag("--revision", help=REVISION_HELP)
    flag("--pp", 1, type=int, help="pipeline stages (default 1)")
    flag("--tp", 1, type=int, help="tensor-parallel degree per stage (default 1)")
    flag("--dtype", "float32", choices=DType.names(),
         help="weight and activation dtype the shards use (default float32)")  # fmt: skip
    flag("--quantize", "none", choices=Quantization.names(), help=QUANTIZE_HELP)
    flag("--heartbeat-interval", 1.0, type=float, help="seconds between worker heartbeats (default 1.0)")
    flag("--heartbeat-timeout", type=float, help="seconds of silence before a worker is UNHEALTHY (default 3×interval)")
    flag("--recovery-grace", type=float, help="seconds a (re)started coordinator keeps slots for the workers "
         "that held them to claim them back, telling watchers nothing meanwhile (default 2×timeout)")  # fmt: skip
    flag("--replan-after", 10.0, type=float, help="seconds a lost worker's slot may wait (no spare) before the model "
         "is re-planned onto fewer stages of the healthy workers, memory allowing; a drain re-plans at once; "
         "negative: never (default 10)")  # fmt: skip
    flag("--move-gain", 1.3, type=float, help="move a slot onto a faster spare when that makes the pipeline at "
         "least this many times faster, by the workers' speeds (shardmesh worker --speed); 0 never moves "
         "(default 1.3)")  # fmt: skip
    flag("--move-interval", 30.0, type=float, help="seconds between two such moves, at least (default 30)")
    flag("--store-host", help="host workers reach the rendezvous store at (default: the --listen host)")
    flag("--store-port", 0, type=int, help="port of the rendezvous TCPStore; 0 picks a free one (default)")
    flag("--kv-slots", 8, type=int, help="KV-cache slots per shard: sequences in flight (default 8)")
    flag("--max-context", type=int, help="tokens per sequence, prompt + completion (default: the model's)")
    flag("--max-batch-tokens", type=int, help="tokens per step over the batch (default: --max-context)")
    flag("--kv-block-size", 0, type=int, help="tokens per block of a paged KV cache, e.g. 16: the gateway hands "
         "blocks out to sequences as they grow and shares a cached prompt prefix's; 0: a slot of --max-context "
         "tokens per sequence (default 0)")  # fmt: skip
    flag("--kv-cache-memory", metavar="SIZE", help="with --kv-block-size: bytes per shard for the paged KV cache and "
         "activation log, e.g. 2GiB; the blocks it buys on the most loaded shard are every shard's (default: what "
         "the slot cache would take, --kv-slots x --max-context tokens)")  # fmt: skip
    flag("--max-message-mb", 64, type=int, help="gRPC max send/receive message size in MiB (default 64)")
    flag("--layers", help="layers per pipeline stage, e.g. 18,12 (default: as even as possible)")
    flag("--tp-split", help="each tensor-parallel rank's share of the MLP columns and the vocabulary, e.g. 2,1,1 "
         "(rank 0 holds half): ranks on unequal devices, or a rank alone on a core beside two sharing one; the heads "
         "are split evenly (default: all even)")  # fmt: skip
    flag(
        "--rank-nodes",
        help="node label each global rank's worker must have, e.g. nodeA,nodeA,nodeB (from a "
        "manifest's plan; default: any worker takes any rank)",
    )
    flag(
        "--max-stage-ratio",
        1.25,
        type=float,
        help="balance check before serving: report a stage slower than the fastest by more than this (default 1.25)",
    )
    flag(
        "--rebalance",
        "none",
        choices=REBALANCES,
        help="by-speed: re-split layers by the measured stage times when they are out of balance (default none)",
    )
    p.add_argument("--require-balance", action="store_true",
                   default=os.environ.get(ENV_PREFIX + "REQUIRE_BALANCE", "") not in ("", "0", "false"),
                   help="do not serve while the stages are out of balance (default: serve and report) "
                        f"[env {ENV_PREFIX}REQUIRE_BALANCE]")  # fmt: skip
    flag("--calibration-iterations", 5, type=int, help="timed passes of each kind per shard in the balance check")
    flag("--log-level", help="debug, info, warning or error (default: $SHARDMESH_LOG_LEVEL or info)")
    telemetry.add_flags(flag)
    add_tls_flags(flag, "the coordinator")
    flag("--join-token-file", help="the join tokens (one per line, re-read when the file changes) a worker must "
         "present to register and a gateway to watch the topology (every method but GetTopology); the coordinator "
         f"presents the first to the workers it calibrates (default: ${JOIN_TOKEN_ENV}; neither: no token "
         "needed)")  # fmt: skip


def _listen_host(listen: str) -> str:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen: expected host:port (port 0-65535), got {listen!r}")
    return host


SECURITY_FLAGS = ("tls_cert", "tls_key", "tls_ca", "join_token_file")  # set by a manifest's services.security, if any
# Flags a manifest sets (and which may then not be given as well); the rest (log level, heartbeats, ...) stay free.
MANIFEST_FLAGS = ("model", "revision", "pp", "tp", "dtype", "quantize", "kv_slots", "max_context", "max_batch_tokens",
                  "kv_block_size", "kv_cache_memory", "store_port", "layers", "rank_nodes", "max_stage_ratio",
                  "rebalance", "require_balance")  # fmt: skip


def from_manifest(args: argparse.Namespace, defaults: argparse.Namespace) -> argparse.Namespace:
    """`args` with what the manifest at `args.manifest` sets, through the same flags `shardmesh plan` prints."""
    from shardmesh.planning import deploy
    from shardmesh.planning.manifest import ManifestError, load_manifest
    from shardmesh.planning.planner import PlanError

    given = [k for k in MANIFEST_FLAGS if getattr(args, k) != getattr(defaults, k)]
    if given:
        raise UsageError("; ".join(f"--{k.replace('_', '-')}: set by --manifest, give one or the other" for k in given))
    source = Path(args.manifest)
    try:
        d = deploy.resolve(load_manifest(source), source)
    except (ManifestError, PlanError) as e:
        raise UsageError(str(e).replace("\n", "; ")) from None
    flags = deploy.coordinator_flags(d)
    if args.listen != defaults.listen:  # a bind address given here wins (e.g. 0.0.0.0:50051 in a container)
        i = flags.index("--listen")
        del flags[i : i + 2]
    parser = argparse.ArgumentParser(prog="coordinator --manifest", add_help=False)
    add_arguments(parser)
    parsed = parser.parse_args(flags)
    out = argparse.Namespace(**vars(args))
    for k in (*MANIFEST_FLAGS, "otlp_endpoint", "metrics_port", "listen"):
        if k != "listen" or "--listen" in flags:
            setattr(out, k, getattr(parsed, k))
    # services.security, where the manifest sets it; given here as well is refused like the flags above
    security = [k for k in SECURITY_FLAGS if f"--{k.replace('_', '-')}" in flags]
    clash = [k for k in security if getattr(args, k) != getattr(defaults, k)]
    if clash:
        raise UsageError("; ".join(f"--{k.replace('_', '-')}: set by --manifest (services.security), give one or the "
                                   "other" for k in clash))  # fmt: skip
    for k in security:
        setattr(out, k, getattr(parsed, k))
    return out


def build_config(args: argparse.Namespace) -> Any:
    """Validate every flag against each other and the model; returns a `CoordinatorConfig`."""
    from coordinator.calibration import CalibrationConfig
    from coordinator.process import CoordinatorConfig
    from shardmesh.core.config import ModelConfig
    from shardmesh.core.heads import HeadSplit, TensorParallelError, check_tp_split, parse_tp_split
    from shardmesh.core.layout import parse_split, shard_specs, split_layers
    from shardmesh.core.topology import ModelSpec, ServingLimits
    from shardmesh.models.registry import RevisionError, UnknownModelError, resolve

    host = _listen_host(args.listen)
    if not args.model:
        raise UsageError("--model or --manifest is required")
    if args.dtype not in DType.names():  # a value from the environment skips argparse's `choices`
        raise UsageError(f"--dtype: must be one of {', '.join(DType.names())}, got {args.dtype!r}")
    if args.quantize not in Quantization.names():
        raise UsageError(f"--quantize: must be one of {', '.join(Quantization.names())}, got {args.quantize!r}")
    try:
        model_dir = resolve(args.model, revision=args.revision)
    except RevisionError as e:
        raise UsageError(f"--revision: {e}") from None
    except UnknownModelError as e:
        raise UsageError(f"--model: {e}") from None
    try:
        cfg = ModelConfig.from_dir(model_dir)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"--model: {e}") from None
    if args.pp < 1 or args.tp < 1:
        raise UsageError(f"--pp and --tp must be >= 1, got pp={args.pp} tp={args.tp}")
    try:
        shard_specs(cfg.num_layers, args.pp, args.tp)
    except ValueError as e:
        raise UsageError(f"--pp: {e}") from None
    try:
        HeadSplit.of(cfg, 0, args.tp)
    except TensorParallelError as e:
        raise UsageError(f"--tp: {e}") from None
    try:
        tp_split = parse_tp_split(args.tp_split or "")
        check_tp_split(cfg, args.tp, tp_split)
    except TensorParallelError as e:
        raise UsageError(f"--tp-split: {e}") from None
    interval = args.heartbeat_interval
    if not interval > 0:
        raise UsageError(f"--heartbeat-interval: must be > 0 seconds, got {interval}")
    timeout = args.heartbeat_timeout if args.heartbeat_timeout is not None else 3 * interval
    if not timeout > interval:
        raise UsageError(f"--heartbeat-timeout: must exceed --heartbeat-interval ({interval} s), got {timeout}")
    grace = args.recovery_grace if args.recovery_grace is not None else 2 * timeout
    if grace < 0:
        raise UsageError(f"--recovery-grace: must be >= 0 seconds, got {grace}")
    if args.move_gain != 0 and not args.move_gain > 1:
        raise UsageError(f"--move-gain: must be > 1 (a speed-up), or 0 to never move, got {args.move_gain}")
    if not args.move_interval >= 0:
        raise UsageError(f"--move-interval: must be >= 0 seconds, got {args.move_interval}")
    if not 0 <= args.store_port <= 65535:
        raise UsageError(f"--store-port: must be in 0..65535, got {args.store_port}")
    if args.kv_slots < 1:
        raise UsageError(f"--kv-slots: must be >= 1, got {args.kv_slots}")
    max_context = args.max_context if args.max_context is not None else cfg.max_context
    if not 1 <= max_context <= cfg.max_context:
        raise UsageError(f"--max-context: must be in 1..{cfg.max_context} (the model's context), got {max_context}")
    max_batch = args.max_batch_tokens if args.max_batch_tokens is not None else max_context
    if max_batch < 1:
        raise UsageError(f"--max-batch-tokens: must be >= 1, got {max_batch}")
    if args.max_message_mb < 1:
        raise UsageError(f"--max-message-mb: must be >= 1, got {args.max_message_mb}")
    try:
        split = tuple(parse_split(args.layers, cfg.num_layers, args.pp)) if args.layers else None
    except ValueError as e:
        raise UsageError(f"--layers: {e}") from None
    limits = _limits(args, cfg, ServingLimits(args.kv_slots, max_context, max_batch),
                     split or tuple(split_layers(cfg.num_layers, args.pp)))  # fmt: skip
    requires = None
    if args.rank_nodes:
        nodes = args.rank_nodes.split(",")
        if len(nodes) != args.pp * args.tp or not all(nodes):
            raise UsageError(
                f"--rank-nodes: need {args.pp * args.tp} node names (one per rank), got {args.rank_nodes!r}"
            )
        requires = tuple((("node", n),) for n in nodes)
    if args.rebalance not in REBALANCES:  # from the environment
        raise UsageError(f"--rebalance: must be one of {', '.join(REBALANCES)}, got {args.rebalance!r}")
    try:
        calibration = CalibrationConfig(max_stage_ratio=args.max_stage_ratio, rebalance=args.rebalance,
                                        require_balance=args.require_balance,
                                        iterations=args.calibration_iterations)  # fmt: skip
    except ValueError as e:
        name, _, msg = str(e).partition(": ")
        raise UsageError(f"--{name.replace('_', '-')}: {msg}") from None
    try:
        telemetry.check_metrics_port(args.metrics_port)
        telemetry.export_config(args.otlp_endpoint)
    except telemetry.TelemetryConfigError as e:
        raise UsageError(str(e)) from None
    tls_files, join_tokens, join_token = mesh_security(args)
    store_host = args.store_host or (socket.gethostname() if host in _WILDCARD_HOSTS else host.strip("[]"))
    # The name as given (a directory, or a model name) is what clients of the OpenAI-compatible API call the model.
    model = ModelSpec(str(model_dir.resolve()), args.dtype, cfg.architecture, cfg.num_layers, cfg.hidden_size,
                      cfg.vocab_size, cfg.max_context, served_model_name=args.model,
                      quantization=args.quantize)  # fmt: skip
    return CoordinatorConfig(
        listen=args.listen, model=model, pp=args.pp, tp=args.tp,
        limits=limits, heartbeat_interval=interval,
        heartbeat_timeout=timeout, store_host=store_host, store_port=args.store_port, recovery_grace=grace,
        replan_after=args.replan_after, rebalance_gain=args.move_gain,
        rebalance_interval=args.move_interval,
        max_message_bytes=args.max_message_mb * 1024 * 1024, metrics_port=args.metrics_port,
        otlp_endpoint=args.otlp_endpoint, split=split, requires=requires, calibration=calibration, tp_split=tp_split,
        tls=tls_files, join_tokens=join_tokens, join_token=join_token,
    )  # fmt: skip


def _limits(args: argparse.Namespace, cfg: ModelConfig, slots: ServingLimits,
            split: tuple[tuple[int, int], ...]) -> ServingLimits:  # fmt: skip
    """`slots` (the slot cache's `ServingLimits`) or, with --kv-block-size, the paged cache's: its blocks from
    --kv-cache-memory at what one block costs the most loaded shard of the placement `split` × --tp."""
    from shardmesh.core.units import parse_bytes
    from shardmesh.planning.kv_blocks import paged_limits, placement_block_bytes

    if args.kv_block_size < 0:
        raise UsageError(f"--kv-block-size: must be >= 0 (0: a slot per sequence), got {args.kv_block_size}")
    if not args.kv_block_size:
        if args.kv_cache_memory is not None:
            raise UsageError("--kv-cache-memory: sizes a paged KV cache, give --kv-block-size too (the slot cache is "
                             "sized by --kv-slots and --max-context)")  # fmt: skip
        return slots
    try:
        memory = parse_bytes(args.kv_cache_memory) if args.kv_cache_memory is not None else None
    except ValueError as e:
        raise UsageError(f"--kv-cache-memory: {e}") from None
    per_block = placement_block_bytes(cfg, split, args.tp, args.kv_block_size, DType.parse(args.dtype).itemsize)
    try:
        return paged_limits(slots, args.kv_block_size, per_block, memory)
    except ValueError as e:
        raise UsageError(f"--kv-cache-memory: {str(e).removeprefix('kv_cache_memory: ')}") from None


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (exit 0)."""
    from coordinator.process import CoordinatorServer
    from shardmesh.rpc import lifecycle, log

    if args.manifest:
        defaults = argparse.ArgumentParser(add_help=False)
        add_arguments(defaults)
        args = from_manifest(args, defaults.parse_args([]))
    cfg = build_config(args)  # a UsageError reaches the command's main: one line, exit 2
    logger = log.configure("coordinator", level=args.log_level)
    telemetry.setup_tracing("coordinator", args.otlp_endpoint)
    lifecycle.serve_until_signal(CoordinatorServer(cfg, logger), logger)
    return 0
