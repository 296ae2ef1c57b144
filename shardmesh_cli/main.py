"""The `shardmesh` command: one entry point for every service and tool, configured by flags."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from shardmesh.core.dtypes import QUANTIZE_HELP, DType, Quantization
from shardmesh.core.layout import REBALANCES
from shardmesh.engine import compute_priority
from shardmesh.models.hub import MODEL_HELP, REVISION_HELP
from shardmesh.rpc.flags import EXIT_USAGE, UsageError, add_client_tls_flags

# `--device` of `up` and `generate` (shardmesh/core/device_map.py): NCCL refuses two ranks on one GPU.
DEVICE_HELP = ("cpu; cuda: a GPU of its own for each of the pp×tp ranks, rank r on cuda:r; cuda:N: the one rank "
               "(pp=tp=1) on GPU N; or a comma-separated list, one entry per stage or one per rank, each cpu, cuda "
               "(the next GPU no entry names) or cuda:N, e.g. cpu,cuda (default cpu)")  # fmt: skip


def resolve_model(arg: str, revision: str | None = None, cache_dir: Path | None = None, flag: str = "--model") -> Path:
    """`--model` (and `--revision`) as every command resolves them (`registry.resolve`): a name that cannot be
    served is a usage error naming `flag`, a revision that cannot apply one naming `--revision`."""
    from shardmesh.models.registry import RevisionError, UnknownModelError, resolve

    try:
        return resolve(arg, cache_dir, revision=revision)
    except RevisionError as e:
        raise UsageError(f"--revision: {e}") from None
    except UnknownModelError as e:
        raise UsageError(f"{flag}: {e}") from None


def _parse_token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(f"--token-ids: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--token-ids: at least one token id is needed")
    return ids


def _prompt_ids(args: argparse.Namespace, model_dir: Path, vocab_size: int) -> tuple[list[int], Any]:
    from shardmesh.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    if args.token_ids is not None:
        if args.prompt:
            raise UsageError("give either a PROMPT or --token-ids, not both")
        ids = _parse_token_ids(args.token_ids)
    else:
        if not args.prompt:
            raise UsageError("a PROMPT or --token-ids is required")
        if tokenizer is None:
            raise UsageError(f"{model_dir} has no tokenizer.json: pass --token-ids instead of a PROMPT")
        if tokenizer.chat_template and not args.raw:
            ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        else:
            ids = tokenizer.encode(args.prompt, add_special_tokens=True)
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UsageError(f"--token-ids: {bad} outside the vocabulary [0, {vocab_size})")
    return ids, tokenizer


def _generate_via_gateway(args: argparse.Namespace) -> int:
    """`generate --gateway ADDR`: the same request and output, served by a running gateway."""
    from gateway import client

    token_ids = None
    if args.token_ids is not None:
        if args.prompt:
            raise UsageError("give either a PROMPT or --token-ids, not both")
        token_ids = _parse_token_ids(args.token_ids)
    elif not args.prompt:
        raise UsageError("a PROMPT or --token-ids is required")
    return client.generate(args, token_ids)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens <= 0:
        raise UsageError(f"--max-new-tokens: must be > 0, got {args.max_new_tokens}")
    if args.gateway:  # before the torch imports below: the client needs none of them
        return _generate_via_gateway(args)

    # Every flag is checked before torch is imported (~1.5 s of a 2-core CPU): a mistyped flag is answered at once.
    from shardmesh.core import device_map
    from shardmesh.core.config import ModelConfig
    from shardmesh.core.step import SamplingParams

    if args.model is None:
        raise UsageError("--model is required (or --gateway ADDR to use a running gateway)")
    try:  # each rank on a device of its own (`generate_local` checks it again, for callers of its own)
        device_map.rank_devices(args.device, args.pp, args.tp)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.stop:
        raise UsageError("--stop: stop strings need --gateway")
    model_dir = resolve_model(args.model, args.revision)
    cfg = ModelConfig.from_dir(model_dir)
    ids, tokenizer = _prompt_ids(args, model_dir, cfg.vocab_size)
    try:  # `generate_local` checks it again, for callers of its own
        cfg.check_fits(len(ids), args.max_new_tokens, name="--max-new-tokens")
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    except ValueError as e:
        raise UsageError(f"--{str(e).split()[0].replace('_', '-')}: {e}") from None
    stop_ids = tuple(sorted(tokenizer.eos_token_ids)) if tokenizer is not None else cfg.eos_token_ids
    budget = None
    if args.memory_budget is not None:
        from shardmesh.core.units import parse_bytes

        try:
            budget = parse_bytes(args.memory_budget)
        except ValueError as e:
            raise UsageError(f"--memory-budget: {e}") from None
    if args.kv_block_size < 0:
        raise UsageError(f"--kv-block-size: must be >= 0 (0: one slot), got {args.kv_block_size}")
    from shardmesh_cli.offline import OfflineRequest, generate_local

    request = OfflineRequest(ids, args.max_new_tokens, sampling, stop_ids)
    result = generate_local(model_dir, request, args.pp, args.tp, args.dtype, args.device, quantization=args.quantize,
                            memory_budget=budget, kv_block_size=args.kv_block_size,
                            link_staging=args.link_staging)  # fmt: skip
    text = tokenizer.decode(result.token_ids) if tokenizer is not None else ""
    if args.json:
        out = {"token_ids": result.token_ids, "logprobs": result.logprobs, "text": text,
               "finish_reason": result.finish_reason}  # fmt: skip
        print(json.dumps(out))
    else:
        print(text if tokenizer is not None else " ".join(map(str, result.token_ids)))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from shardmesh_cli import up

    # --- up --manifest: the manifest sets model, parallelism, limits and addresses (shardmesh/planning) ---
    if args.manifest:
        from shardmesh.planning.manifest import ManifestError
        from shardmesh.planning.planner import PlanError

        if args.revision is not None:
            raise UsageError("--revision: the manifest sets the model (model.path, model.revision)")
        try:
            args, notes = up.args_from_manifest(args, args.up_defaults)
        except ManifestError as e:
            raise UsageError("\nerror: ".join(f"{e.source}: {line}" for line in e.errors)) from None
        except PlanError as e:
            raise UsageError(f"{args.manifest}: {e}") from None
        for note in notes:
            print(note, file=sys.stderr, flush=True)
    elif args.model is None:
        raise UsageError("--model is required (or --manifest FILE)")
    # --- end up --manifest ---
    if getattr(args, "tls_dir", None) and not args.tls:
        raise UsageError("--tls-dir: only with --tls")
    if args.pp < 1 or args.tp < 1:
        raise UsageError("--pp and --tp must be >= 1")
    if args.spares < 0:
        raise UsageError(f"--spares: must be >= 0, got {args.spares}")
    if args.worker_threads is not None and args.worker_threads < 1:
        raise UsageError(f"--worker-threads: must be >= 1, got {args.worker_threads}")
    if (refused := compute_priority.realtime_refused(getattr(args, "compute_priority", "auto"))) is not None:
        raise UsageError(refused)
    if getattr(args, "tp_split", "auto") not in ("auto", "even"):
        from shardmesh.core.heads import TensorParallelError, parse_tp_split

        try:
            shares = parse_tp_split(args.tp_split)
        except TensorParallelError as e:
            raise UsageError(f"--tp-split: {e}") from None
        if len(shares) != args.tp:
            raise UsageError(f"--tp-split: {len(shares)} shares for --tp {args.tp}; give one per rank, or auto or even")
    try:  # every rank on a device of its own, before anything starts
        up.worker_devices(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.http_listen is not None:
        _, sep, port = args.http_listen.rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            raise UsageError(f"--http-listen: expected host:port (port 0-65535), got {args.http_listen!r}")
        if args.no_http:
            raise UsageError("--http-listen and --no-http: give one or the other")
    model_dir = resolve_model(args.model, args.revision)
    demo = None
    if args.demo is not None:

        def demo(gateway: str, **credentials: Any) -> int:
            from gateway import client

            request = argparse.Namespace(gateway=gateway, prompt=args.demo, token_ids=None, raw=False, json=False,
                                         max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                                         seed=None, stop=None, timeout=None, **credentials)  # fmt: skip
            print(f"> {args.demo}", flush=True)
            return client.generate(request, None)

    return up.run(args, model_dir, demo)


def cmd_model_pull(args: argparse.Namespace) -> int:
    """The directory `--model NAME` resolves to, fetched (or converted) now: every command takes NAME then."""
    from shardmesh.models.registry import REGISTRY

    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    if cache_dir is not None and args.name not in REGISTRY:
        raise UsageError("--cache-dir: only built-in models are converted into shardmesh's cache; a Hugging Face "
                         "model stays in the hub cache (HF_HOME or HF_HUB_CACHE)")  # fmt: skip
    print(resolve_model(args.name, args.revision, cache_dir, flag="MODEL"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardmesh", description="A sharded LLM inference mesh over gRPC.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from a model sharded over local processes, or via a gateway")
    g.add_argument("prompt", nargs="?", help="user message (wrapped in the chat template when the model has one)")
    g.add_argument("--model", help=f"{MODEL_HELP}; required without --gateway")
    g.add_argument("--revision", default=None, help=REVISION_HELP)
    g.add_argument("--token-ids", help="comma-separated prompt token ids, instead of a PROMPT")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template to PROMPT")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree per stage (default 1)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="float32", choices=DType.names())
    g.add_argument("--quantize", default="none", choices=Quantization.names(), help=QUANTIZE_HELP)
    g.add_argument("--link-staging", default="auto", choices=["auto", "host"], help="how stage links move "
                   "activations: auto (NCCL between two GPUs, else Gloo through host memory) or host (always Gloo "
                   "through host memory)")  # fmt: skip
    g.add_argument("--device", default="cpu", help=DEVICE_HELP)
    g.add_argument("--memory-budget", metavar="SIZE", default=None,
                   help="weights each process may hold in memory, e.g. 2GiB: the layers that do not fit stream from "
                        "the checkpoint for every step (cpu; default: all resident)")  # fmt: skip
    g.add_argument("--kv-block-size", type=int, default=0,
                   help="tokens per block of a paged KV cache (the layout `up --kv-block-size` serves with), e.g. 16; "
                        "0: one slot (default 0)")  # fmt: skip
    g.add_argument(
        "--json", action="store_true", help="print one JSON object: token_ids, logprobs, text, finish_reason"
    )
    # --gateway mode: the request goes to a running `shardmesh gateway` (see gateway/client.py).
    g.add_argument("--gateway", metavar="ADDR", help="host:port of a running gateway to send the request to")
    g.add_argument("--stop", action="append", help="stop string, repeatable (with --gateway)")
    g.add_argument("--timeout", type=float, default=None, help="seconds to wait for the gateway (with --gateway)")
    g.add_argument("--api-key-file", help="a gateway with API keys: present the file's first line (with --gateway; "
                   "default: $SHARDMESH_API_KEY)")  # fmt: skip
    add_client_tls_flags(g)  # with --gateway, for a mesh that runs mutual TLS
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("model", help="manage local models")
    msub = m.add_subparsers(dest="model_command", required=True)
    mp = msub.add_parser("pull", help="fetch a model into its cache now (a built-in one is converted there), and "
                         "print the directory it resolves to")  # fmt: skip
    mp.add_argument("name", metavar="MODEL", help=MODEL_HELP)
    mp.add_argument("--revision", default=None, help=REVISION_HELP)
    mp.add_argument(
        "--cache-dir",
        default=None,
        help="shardmesh's cache for built-in models (default: $SHARDMESH_CACHE or ~/.cache/shardmesh)",
    )
    mp.set_defaults(func=cmd_model_pull)

    # --- coordinator: membership and placement service (flags and validation live in coordinator/app.py) ---
    from coordinator import app as coordinator_app

    c = sub.add_parser("coordinator", help="run the coordinator: worker registry, placement, topology versions")
    coordinator_app.add_arguments(c)
    c.set_defaults(func=coordinator_app.run)
    # --- end coordinator ---

    # --- gateway: the client API over the mesh (flags and validation live in gateway/app.py) ---
    from gateway import app as gateway_app

    gw = sub.add_parser("gateway", help="run the gateway: client API, batching over the stage workers")
    gateway_app.add_arguments(gw)
    gw.set_defaults(func=gateway_app.run)
    # --- end gateway ---

    from shardworker import app as worker_app

    w = sub.add_parser("worker", help="run a stage worker: holds the shard the coordinator assigns it")
    worker_app.add_arguments(w)
    w.set_defaults(func=worker_app.run)

    # --- top: a live terminal view of the mesh (shardmesh_cli/top.py) ---
    from shardmesh_cli import top

    t = sub.add_parser("top", help="watch the mesh: workers' memory, links and steps; the gateway's latency")
    top.add_arguments(t)
    t.set_defaults(func=top.run)
    # --- end top ---

    u = sub.add_parser("up", help="run the whole mesh locally: coordinator, P×T workers, gateway")
    u.add_argument("--model", default=None, help=f"{MODEL_HELP}; required without --manifest")
    u.add_argument("--revision", default=None, help=REVISION_HELP)
    u.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    u.add_argument("--tp", type=int, default=1, help="tensor-parallel degree per stage (default 1)")
    u.add_argument("--dtype", default="float32", choices=DType.names())
    u.add_argument("--quantize", default="none", choices=Quantization.names(), help=QUANTIZE_HELP)
    u.add_argument(
        "--memory-budget",
        default=None,
        help="bytes of weights each worker holds in memory, e.g. "
        "300MiB; the layers beyond it stream from the checkpoint every step (CPU; default: all)",
    )
    u.add_argument("--device", default="cpu", help=DEVICE_HELP + "; --spares take the GPUs no rank uses")
    u.add_argument("--listen", default=None, help="gateway host:port (default 127.0.0.1 and a free port)")
    u.add_argument("--http-listen", default=None,
                   help="host:port of the gateway's OpenAI-compatible HTTP API, printed as 'http: http://HOST:PORT/v1' "
                        "(default 127.0.0.1 and a free port)")  # fmt: skip
    u.add_argument("--no-http", action="store_true", help="no OpenAI-compatible HTTP API, gRPC only")
    u.add_argument("--served-model-name", default=None,
                   help="the model id of the HTTP API and the model_name label of the gateway's metrics "
                        "(default: --model as given)")  # fmt: skip
    u.add_argument("--api-key", default=None,
                   help="gRPC calls and HTTP requests must send 'Authorization: Bearer KEY' (default: "
                        "$SHARDMESH_API_KEY; unset: no key needed)")  # fmt: skip
    u.add_argument("--api-key-file", default=None,
                   help="the API keys the gateway accepts, one per line, re-read when the file changes")  # fmt: skip
    u.add_argument("--tls", action="store_true",
                   help="mutual TLS on every gRPC connection, HTTPS on the HTTP API, and a join token for the workers "
                        "and the gateway: the CA, certificates and token are made in --tls-dir, or reused from it "
                        "(see `shardmesh certs init`)")  # fmt: skip
    u.add_argument("--tls-dir", default=None, help="with --tls: where the CA, the certificates and the join token are "
                   "(default: LOG_DIR/tls)")  # fmt: skip
    u.add_argument("--kv-slots", type=int, default=8, help="sequences in flight per shard (default 8)")
    u.add_argument("--max-context", type=int, default=None, help="tokens per sequence (default: the model's)")
    u.add_argument("--max-batch-tokens", type=int, default=None, help="tokens per step (default: --max-context)")
    u.add_argument("--kv-block-size", type=int, default=0,
                   help="tokens per block of a paged KV cache, e.g. 16; 0: a slot per sequence "
                        "(default 0)")  # fmt: skip
    u.add_argument("--kv-cache-memory", metavar="SIZE", default=None,
                   help="with --kv-block-size: bytes per shard for the paged KV cache, e.g. 2GiB (default: what "
                        "the slot cache would take)")  # fmt: skip
    u.add_argument("--log-dir", default=None, help="where each service's JSON log goes (default: a new temp dir)")
    u.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for SERVING (default 600)")
    u.add_argument("--spares", type=int, default=0,
                   help="hot spare workers beyond the pp×tp stage workers: one takes the slot of a worker that is "
                        "lost or drained (default 0)")  # fmt: skip
    u.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of each worker or the coordinator when it dies (default 3)")  # fmt: skip
    u.add_argument("--worker-threads", type=int, default=None,
                   help="torch threads per worker (default: the cores divided among the workers that compute at "
                        "once; see --pipeline)")  # fmt: skip
    u.add_argument("--pipeline", default="auto", choices=["auto", "full", "turns"],
                   help="full: one step in flight per stage, every stage busy at once, the cores split among all "
                        "workers; turns: one step in flight, each stage on all the cores when its turn comes; "
                        "auto (default): turns on cpu with --pp > 1 (the stages share this host's cores), "
                        "else full")  # fmt: skip
    u.add_argument("--compute-priority", default="auto", choices=["auto", *compute_priority.PRIORITIES],
                   help="scheduling priority of each worker's compute thread and its OpenMP threads: realtime "
                        "(SCHED_RR 1; needs CAP_SYS_NICE or `ulimit -r` >= 1), normal, or auto (default): realtime "
                        "where every worker computes on the CPU, their threads fit the cores and the OS allows it, "
                        "else normal")  # fmt: skip
    u.add_argument("--tp-split", default="auto",
                   help="each tensor-parallel rank's share of the MLP columns and the vocabulary, e.g. 2,1,1; "
                        "even: equal shares; auto (default): where a stage's CPU ranks outnumber the cores by one "
                        "(tp=3 on 2 cores), shares that give every core two, each rank pinned to its core; "
                        "else even")  # fmt: skip
    u.add_argument("--demo", metavar="PROMPT", default=None, help="stream one answer to PROMPT, then stop")
    u.add_argument("--max-new-tokens", type=int, default=128, help="length of the --demo answer (default 128)")
    u.add_argument("--otlp-endpoint", default=None, help="send every service's spans to this OTLP endpoint")
    u.add_argument(
        "--metrics", action="store_true", help="Prometheus metrics on every service, on free ports printed at start"
    )
    u.add_argument("--layers", default=None, help="layers per pipeline stage, e.g. 18,12 (default: even)")
    u.add_argument(
        "--rebalance",
        default="none",
        choices=REBALANCES,
        help="by-speed: re-split layers by the stage times the balance check measures (default none)",
    )
    u.add_argument(
        "--max-stage-ratio",
        type=float,
        default=1.25,
        help="balance check: report a stage slower than the fastest by more than this (default 1.25)",
    )
    u.add_argument("--require-balance", action="store_true", help="do not serve while the stages are out of balance")
    u.add_argument("--manifest", metavar="FILE", default=None,
                   help="deploy what this YAML manifest describes (see compose/manifest.example.yaml)")  # fmt: skip
    u.set_defaults(func=cmd_up)
    u.set_defaults(up_defaults={a.dest: a.default for a in u._actions})  # what `--manifest` checks against
    # --- status: the topology and its balance check, once (shardmesh_cli/status.py) ---
    from shardmesh_cli import status as status_command

    st = sub.add_parser("status", help="show the mesh: placement, shard states and the balance check before serving")
    status_command.add_arguments(st)
    st.set_defaults(func=status_command.run)
    # --- end status ---
    # --- drain: take a worker out of service without failing a request (shardmesh_cli/drain.py) ---
    from shardmesh_cli import drain as drain_command

    dr = sub.add_parser("drain", help="take a worker out of service: a spare takes its slot, then it exits")
    drain_command.add_arguments(dr)
    dr.set_defaults(func=drain_command.run)
    # --- end drain ---
    # --- certs: a development CA and the services' certificates for mutual TLS (shardmesh_cli/certs.py) ---
    from shardmesh_cli import certs as certs_command

    ce = sub.add_parser("certs", help="make a development CA and certificates for mutual TLS between the services")
    certs_command.add_arguments(ce)
    # --- end certs ---
    # --- plan: split a model over devices, or show what a manifest deploys (shardmesh_cli/plan.py) ---
    from shardmesh_cli import plan as plan_command

    pl = sub.add_parser("plan", help="plan the split of a model over devices from its size and their memory")
    plan_command.add_arguments(pl)
    pl.set_defaults(func=plan_command.run)
    # --- end plan ---
    return p


def main(argv: list[str] | None = None) -> int:
    from shardmesh.rpc import procs

    procs.die_with_parent_if_asked()
    args = build_parser().parse_args(argv)
    if args.command in ("generate",) and (args.pp < 1 or args.tp < 1):
        print("error: --pp and --tp must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
        # Config, checkpoint and placement errors already name their file and field.
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
