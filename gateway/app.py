"""`shardmesh gateway`: flags (each also settable as SHARDMESH_GATEWAY_<FLAG>), validation, run.

Bad flags are reported as one line with exit code 2 before anything listens. This module imports
only the standard library at import time, so building the `shardmesh` parser stays cheap; the
service (grpc, tokenizers) is imported when the command runs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from shardmesh.core.step import MAX_DECODE_STEPS
from shardmesh.rpc.flags import JOIN_TOKEN_ENV, UsageError, add_tls_flags, env_flags, mesh_security

ENV_PREFIX = "SHARDMESH_GATEWAY_"
API_KEY_ENV = "SHARDMESH_API_KEY"  # also read by `shardmesh up`, which passes it on to its gateway


def add_arguments(p: argparse.ArgumentParser) -> None:
    flag = env_flags(p, ENV_PREFIX)
    flag("--listen", "127.0.0.1:50050", help="host:port for the gRPC server; port 0 picks a free one")
    flag("--coordinator", required=True, help="host:port of the coordinator whose topology the gateway serves on")
    flag("--max-queue", 256, type=int, help="waiting requests before RESOURCE_EXHAUSTED (default 256)")
    # 8 MiB: far above any request that fits a context (the prompt byte bound, gateway/tokenizing.py), and low enough
    # that a flood of oversized messages, which gRPC receives before any check runs, keeps streams within 3x of their
    # pace (64 MiB: 6x; bench/results/vm-2026-11-24-hostile-input.md).
    flag("--max-message-bytes", 8 * 1024 * 1024, type=int,
         help="gRPC max send/receive message size, on the server and the worker channels (default 8 MiB)")  # fmt: skip
    flag("--default-max-new-tokens", 256, type=int,
         help="length for requests that leave max_new_tokens at 0, capped to the context (default 256)")  # fmt: skip
    flag("--step-timeout", 120.0, type=float, help="seconds a worker may take for one step before it is lost")
    flag("--resume-timeout", 60.0, type=float,
         help="seconds a running request whose worker was lost waits for a complete mesh to replay its tokens on, "
              "before it fails with UNAVAILABLE (default 60)")  # fmt: skip
    flag("--pipeline-depth", 0, type=int,
         help="steps in flight at once (default 0: one per pipeline stage, every stage busy at once; 1: the stages "
              "take turns, for stages that share the same cores)")  # fmt: skip
    flag("--decode-steps", 8, type=int,
         help="with one step in flight (a single stage, or stages taking turns: --pipeline-depth 1), decode steps "
              "the workers run per call while every sequence in the batch decodes and none waits for a slot: the "
              "round trip is paid once per that many tokens, and a streaming client receives them together "
              f"(default 8; 1: a call per token; at most {MAX_DECODE_STEPS})")  # fmt: skip
    flag("--admission-window", 0.002, type=float,
         help="seconds without a new request that a burst gets to gather before the step after one that took new "
              "requests in, while KV slots are free and no step is in flight (at most 10 such windows): where the "
              "workers hold every core during a step, requests come in between steps, and a burst would otherwise "
              "be prefilled a few at a time; a lone request's first decode step starts that much later (default "
              "0.002; 0: off)")  # fmt: skip
    flag("--shutdown-grace", 5.0, type=float, help="seconds running requests get to finish on SIGTERM (default 5)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   default=os.environ.get(ENV_PREFIX + "NO_PREFIX_CACHING", "") in ("", "0", "false"),
                   help="on a paged mesh (coordinator --kv-block-size), prefill every prompt whole instead of reusing "
                        "the blocks of a prefix an earlier request computed (on by default) "
                        f"[env {ENV_PREFIX}NO_PREFIX_CACHING]")  # fmt: skip
    flag("--model-dir", help="where to read the tokenizer (default: the model path in the coordinator's topology)")
    flag("--http-listen", help="host:port for the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
         "/v1/models, /health); port 0 picks a free one (default: off)")  # fmt: skip
    flag("--served-model-name", help="the model id the HTTP API answers to and reports (default: the coordinator's "
         "--model as given)")  # fmt: skip
    flag("--api-key", help="gRPC calls and HTTP requests to /v1 must send 'authorization: Bearer KEY' (default: "
         "$SHARDMESH_API_KEY; prefer --api-key-file or the variable: a command line shows in `ps`)")  # fmt: skip
    flag("--api-key-file", help="the API keys clients may present, one per line (# comments), re-read when the file "
         "changes; with --api-key or $SHARDMESH_API_KEY, any of them is accepted (none of the three: no key "
         "needed)")  # fmt: skip
    flag("--log-level", help="debug, info, warning or error (default: $SHARDMESH_LOG_LEVEL or info)")
    from shardmesh.rpc import telemetry  # standard library only at import time

    telemetry.add_flags(flag)
    flag("--trace-decode-steps", 8, type=int,
         help="decode steps traced per request, each with one span per shard; later ones are only counted on the "
              "request span (default 8)")  # fmt: skip
    add_tls_flags(flag, "the gateway")  # and, with --http-listen, the certificate of HTTPS
    flag("--join-token-file", help="the join token (the file's first line) presented to the coordinator (to watch the "
         f"topology) and to the workers (default: ${JOIN_TOKEN_ENV}; neither: none presented)")  # fmt: skip


def _check_address(flag: str, value: str, *, dial: bool = False) -> None:
    """host:port; an address to dial (`dial`) needs a host and a real port, one to listen on may use 0."""
    host, sep, port = value.rpartition(":")
    lowest = 1 if dial else 0
    if not sep or not port.isdigit() or not lowest <= int(port) <= 65535 or (dial and not host):
        raise UsageError(f"{flag}: expected host:port (port {lowest}-65535), got {value!r}")


def build_config(args: argparse.Namespace) -> Any:
    """Validate the flags; returns a `GatewayConfig`."""
    from gateway.process import GatewayConfig
    from shardmesh.rpc import telemetry

    _check_address("--listen", args.listen)
    _check_address("--coordinator", args.coordinator, dial=True)
    if args.http_listen is not None:
        _check_address("--http-listen", args.http_listen)
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name: must not be empty")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    from shardmesh.rpc import tokens

    try:
        api_keys = tokens.TokenSource.optional("API key", [api_key] if api_key else [], args.api_key_file,
                                               flag="--api-key-file")  # fmt: skip
    except tokens.TokenError as e:
        raise UsageError(str(e)) from None
    tls, _, join_token = mesh_security(args)  # the gateway accepts no join token: its callers present API keys
    checks = [
        ("--max-queue", args.max_queue >= 1, ">= 1"),
        ("--max-message-bytes", args.max_message_bytes >= 1024, ">= 1024"),
        ("--default-max-new-tokens", args.default_max_new_tokens >= 1, ">= 1"),
        ("--step-timeout", args.step_timeout > 0, "> 0 seconds"),
        ("--resume-timeout", args.resume_timeout >= 0, ">= 0 seconds"),
        ("--pipeline-depth", args.pipeline_depth >= 0, ">= 0"),
        ("--decode-steps", 1 <= args.decode_steps <= MAX_DECODE_STEPS, f"in [1, {MAX_DECODE_STEPS}]"),
        ("--admission-window", 0 <= args.admission_window <= 1, "in [0, 1] seconds"),
        ("--shutdown-grace", args.shutdown_grace >= 0, ">= 0 seconds"),
        ("--trace-decode-steps", args.trace_decode_steps >= 0, ">= 0"),
    ]
    for name, ok, rule in checks:
        if not ok:
            raise UsageError(f"{name}: must be {rule}, got {getattr(args, name[2:].replace('-', '_'))}")
    try:
        telemetry.check_metrics_port(args.metrics_port)
        telemetry.export_config(args.otlp_endpoint)
    except telemetry.TelemetryConfigError as e:
        raise UsageError(str(e)) from None
    return GatewayConfig(
        listen=args.listen, coordinator=args.coordinator, max_queue=args.max_queue,
        max_message_bytes=args.max_message_bytes, default_max_new_tokens=args.default_max_new_tokens,
        step_timeout=args.step_timeout, resume_timeout=args.resume_timeout, pipeline_depth=args.pipeline_depth,
        decode_steps=args.decode_steps, admission_window=args.admission_window, shutdown_grace=args.shutdown_grace,
        prefix_caching=args.prefix_caching,
        model_dir=args.model_dir,
        metrics_port=args.metrics_port, otlp_endpoint=args.otlp_endpoint, trace_decode_steps=args.trace_decode_steps,
        http_listen=args.http_listen, served_model_name=args.served_model_name, api_key=api_key, api_keys=api_keys,
        tls=tls, join_token=join_token,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (exit 0)."""
    from gateway.process import GatewayServer
    from shardmesh.rpc import lifecycle, log, telemetry

    cfg = build_config(args)  # a UsageError reaches the command's main: one line, exit 2
    logger = log.configure("gateway", level=args.log_level)  # identity on every line, from every thread
    telemetry.setup_tracing("gateway", args.otlp_endpoint)
    try:
        lifecycle.serve_until_signal(GatewayServer(cfg, logger), logger)
    finally:
        telemetry.shutdown_tracing()  # after the server stopped: the last requests' spans go out too
    return 0
