"""`shardmesh up`: the whole mesh as local processes — coordinator, P × T stage workers, gateway.

Each service runs as its own process with exactly the flags compose would give it, so what runs
here is what runs in a deployment. `up` waits until the gateway reports SERVING (which it does only
for a complete topology), prints the gateway address (first: scripts read it), the coordinator's, and the
OpenAI-compatible HTTP API's URL (on by default, at a free loopback port unless `--http-listen` names one;
`--no-http` turns it off), with `--metrics` every service's metrics address and the `shardmesh top` command
that watches them, and on Ctrl-C or SIGTERM stops everything in reverse order; every child also dies with `up`
itself (PR_SET_PDEATHSIG), so none is ever orphaned. `--spares N` starts N workers beyond the plan, which the
coordinator keeps as hot spares. While the mesh runs, a worker or the coordinator that dies is started again
(`--max-restarts` times each); a worker that exits with status 0 was drained (`shardmesh drain`) and stays gone;
the gateway's death ends it.

`--tls` runs the whole mesh over mutual TLS, with a join token for the workers and the gateway (`MeshTls`): the CA,
a certificate per service and the token are made in `--tls-dir` (default LOG_DIR/tls) or reused from there, the
HTTP API serves HTTPS, and `up` prints the flags that tools (status, drain, top, generate --gateway) need.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import secrets
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.app import API_KEY_ENV
from shardmesh.core.config import ModelConfig
from shardmesh.core.heads import format_tp_split, parse_tp_split
from shardmesh.core.layout import layer_counts
from shardmesh.core.topology import Topology
from shardmesh.engine import compute_priority
from shardmesh.rpc import procs
from shardmesh.rpc.tls import TlsFiles
from shardmesh.rpc.tls import channel as connect

SERVING = health_pb2.HealthCheckResponse.SERVING

PIPELINES = ("auto", "full", "turns")
# A dead worker's restart waits this long when spares cover its slot: SmolLM2 pp=2 on 2 cores, 16 streams, last
# stage killed, longest pause p99 3.0 s when restarted at once, 2.1 s with this delay (bench/failover.py).
SPARE_RESTART_DELAY_S = 3.0
# libgomp's spin count for workers that take turns on the same cores: an idle stage's OpenMP threads
# then sleep after ~10k spins instead of the default 300k, which kept the other stage's cores busy
# (pp=2 on 2 cores, one stream: 36.3 ms/token with the default, 22.2 with 10k; 2k and 50k were no better).
# Set for `turns`, and for workers at real-time priority: a worker alone on its cores (pp=1) ran 2-5% slower at 16
# streams with it at normal priority, and 3.5% faster at one stream at real-time priority (0.942 against 0.977x).
TURNS_SPINCOUNT = "10000"
# --compute-priority: "auto" asks for real-time compute threads on CPU meshes whose computing threads fit the cores,
# where the OS allows it (`shardmesh.engine.compute_priority`: pp=2 on 2 vCPUs measured 1.07-1.15x pp=1's time per
# token without, 0.95-1.0x with; pp=1 itself 0.94-0.98x of its time at normal priority); normal elsewhere.
PRIORITY_ENV = "SHARDMESH_WORKER_COMPUTE_PRIORITY"


@dataclass(frozen=True)
class CoreShare:
    """How the workers of a local mesh share this host's cores."""

    pipeline: str  # "full": every stage computes at once; "turns": one step in flight, stages take turns
    worker_threads: int  # torch threads per worker
    gateway_depth: int  # the gateway's --pipeline-depth (0: one step per stage)
    worker_env: dict[str, str]
    compute_priority: str = "normal"  # the workers' compute threads' (`--compute-priority` as resolved)
    priority_refused: str = ""  # why "auto" left them normal where it would have asked for real-time
    tp_split: tuple[int, ...] = ()  # the coordinator's --tp-split (() even)
    rank_cpus: tuple[int, ...] = ()  # the CPU each stage's tp rank t is pinned to (() none): `uneven_ranks`

    def describe(self, cores: int, stages: int = 2) -> str:
        threads = f"each worker on {self.worker_threads} threads"
        if self.compute_priority == "realtime":
            threads += " at real-time priority (--compute-priority normal: not)"
        elif self.priority_refused:
            threads += f" at normal priority, as real-time was refused: {self.priority_refused}"
        if self.rank_cpus:
            threads += (f"; tp ranks outnumber the cores, so they are split {format_tp_split(self.tp_split)} "
                        f"and pinned to CPUs {','.join(map(str, self.rank_cpus))} (--tp-split even: not)")  # fmt: skip
        if self.pipeline == "turns":
            return (f"pipeline: the stages share this host's {cores} cores, so they take turns (one step in "
                    f"flight), {threads}; --pipeline full keeps every stage busy at once")  # fmt: skip
        if stages == 1:
            return f"workers: {threads}"
        return f"pipeline: full (one step in flight per stage), {threads}"


def share_cores(pp: int, tp: int, device: str | Sequence[str], pipeline: str, worker_threads: int | None, cores: int,
                env: Mapping[str, str] | None = None, priority: str = "normal",
                refusal: Callable[[], str | None] = compute_priority.auto_refusal, tp_split: str = "even",
                intermediate_size: int = 0, cpu_ids: Sequence[int] | None = None) -> CoreShare:  # fmt: skip
    """The thread counts and pipeline depth for P x T workers on one host's `cores`.

    Every worker of a local mesh runs on the same cores. Tensor-parallel ranks of a stage always compute
    at once (their collectives wait for each other), so they split the cores. Pipeline stages need not:
    on CPU, `turns` (the default there) keeps one step in flight and gives each stage all the cores of its
    rank, which measured faster than a full pipeline of one-thread stages (pp=2 on 2 cores, SmolLM2: one
    stream 22 vs 28 ms/token; 16 streams 327 vs 250 tok/s). A full pipeline doubles the weight reads per
    token (two micro-batches) and its stages preempt each other and the gateway on the shared cores.
    With devices of their own (GPUs) the stages do work in parallel: `auto` keeps the pipeline full.

    `priority` (--compute-priority): "auto" gives the workers real-time compute threads when they all compute on the
    CPU, the threads that compute at once fit the cores, and `refusal()` finds nothing against it; normal ones
    otherwise. "realtime" and "normal" as asked (the caller checked "realtime"). Real-time CPU workers get the
    short OpenMP spin too, `turns` or not: a team spinning at real-time priority keeps the gateway off the cores.

    `device`: one for every rank, or each rank's (`worker_devices`). Only the CPU ranks compute on the cores: with
    some ranks on GPUs, the cores are split among the CPU ranks (GPU ranks need few threads).

    `tp_split` (--tp-split): "auto" splits the MLP and the vocabulary unevenly and pins the ranks to CPUs where a
    stage's tensor-parallel ranks outnumber the cores by one (`uneven_ranks`; the model's `intermediate_size` must
    allow it, `cpu_ids` are the CPUs to pin to, default 0..cores-1); "even" never; shares ("2,1,1") as given, unpinned.
    """
    if pipeline not in PIPELINES:
        raise ValueError(f"--pipeline: must be one of {', '.join(PIPELINES)}, got {pipeline!r}")
    env = os.environ if env is None else env
    devices = [device] * (pp * tp) if isinstance(device, str) else list(device)
    on_cpu = sum(d == "cpu" for d in devices)
    if pipeline == "auto":
        pipeline = "turns" if on_cpu == len(devices) and pp > 1 else "full"
    if pipeline == "turns":  # one stage computes at a time, its tensor-parallel ranks at once
        threads, depth = worker_threads or max(1, cores // tp), 1
        at_once = tp * threads
    else:
        computing = on_cpu or len(devices)  # all on GPUs: every worker still gets its share of the cores
        threads, depth = worker_threads or max(1, cores // computing), 0
        at_once = on_cpu * threads
    chosen, refused = _priority(priority, on_cpu == len(devices) and at_once <= cores, refusal)
    spin = pipeline == "turns" or (chosen == "realtime" and on_cpu > 0)
    own = "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env
    extra = {"GOMP_SPINCOUNT": TURNS_SPINCOUNT} if spin and not own else {}
    split: tuple[int, ...] = ()
    pins: tuple[int, ...] = ()
    if tp_split == "auto":
        one_stage_at_once = pp == 1 or pipeline == "turns"
        if on_cpu == len(devices) and one_stage_at_once and threads == 1:
            cpus = list(cpu_ids) if cpu_ids is not None else list(range(cores))
            split, pins = uneven_ranks(tp, cpus, intermediate_size) or ((), ())
    elif tp_split != "even":
        split = parse_tp_split(tp_split)
    return CoreShare(pipeline, threads, depth, {**extra, **_priority_env(chosen)}, chosen, refused, split, pins)


def uneven_ranks(
    tp: int, cpus: Sequence[int], intermediate_size: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """For `tp` one-thread ranks on one more rank than `cpus` (at least 2 of them): each rank's share and CPU, every
    CPU carrying two shares. The first len(cpus) - 1 ranks hold two shares each, alone on a CPU; the last two one each,
    on the last CPU (tp=3 on 2 CPUs: 2,1,1 on CPUs 0,1,1). Even ranks there leave a CPU idle while the other runs two:
    tp=3 on 2 vCPUs is three equal tasks between barriers, one vCPU idle for a third of each layer. None where it does
    not apply or `intermediate_size` is not a multiple of the shares' sum.

    Measured on a 2-vCPU Xeon (SmolLM2 bfloat16, one stream, meshes alternated, 2 rounds): tp=3 ÷ pp=1 1.35-1.37x split
    and pinned, 1.45-1.48x split only, 1.59-1.60x even (docs/performance.md)."""
    if len(cpus) < 2 or tp != len(cpus) + 1:
        return None
    split = (2,) * (len(cpus) - 1) + (1, 1)
    if intermediate_size <= 0 or intermediate_size % sum(split):
        return None
    return split, (*cpus[:-1], cpus[-1], cpus[-1])


def _priority(asked: str, fits: bool, refusal: Callable[[], str | None]) -> tuple[str, str]:
    """`--compute-priority` resolved, and why "auto" stayed normal where it would have asked for real-time. `fits`:
    every rank computes on the CPU and the threads that compute at once fit the cores. Not otherwise: a real-time
    thread that waits by spinning (OpenMP's barriers, the shared-memory collectives' first moments) keeps a queued
    peer of the same priority off its core."""
    if asked != "auto":
        return asked, ""
    if not fits:
        return "normal", ""
    why = refusal()
    return ("normal", why) if why else ("realtime", "")


def _priority_env(priority: str) -> dict[str, str]:
    return {PRIORITY_ENV: priority} if priority == "realtime" else {}


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_PORTS_FROM = 10000  # the lowest port `free_port` picks below the ephemeral range
_HANDED: collections.deque[int] = collections.deque(maxlen=256)  # the ports `free_port` gave out last


def free_port() -> int:
    """A port free on 127.0.0.1 right now, below the OS's ephemeral range where it can, so that no outgoing connection
    (a gRPC channel, a Gloo or store client: their local ports come from that range) takes it between now and the
    service's bind. A port the OS picked from that range once lost that race in a test run: a coordinator started a
    second later found it in use. Where the range cannot be read or leaves no room below it, the OS picks."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = secrets.SystemRandom()
    for _ in range(64 if low > LISTEN_PORTS_FROM + 1000 else 0):
        port = rng.randrange(LISTEN_PORTS_FROM, low)
        if port in _HANDED:  # handed out a moment ago, perhaps not bound yet (up picks several before any binds)
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.append(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class MeshTls:
    """The security material of `up --tls`, in one directory: what `shardmesh certs init` writes (the CA, a
    certificate per service and one for clients) and `join-token`, which the workers and the gateway present (or
    the join token file a manifest names)."""

    directory: Path
    join_token: Path

    JOIN_TOKEN = "join-token"

    @classmethod
    def ensure(cls, directory: Path, join_token: Path | None = None) -> tuple[MeshTls, bool]:
        """Make what is missing (a new CA only when none is there); (the material, whether anything was made)."""
        from shardmesh_cli import certs

        made = certs.ensure(directory)
        token = join_token or directory / cls.JOIN_TOKEN
        if not token.is_file():
            fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
            made = True
        return cls(directory, token), made

    def files(self, name: str) -> TlsFiles:
        """The certificate, key and CA of `name` (coordinator, gateway, worker or client)."""
        return TlsFiles(self.directory / f"{name}.pem", self.directory / f"{name}.key", self.directory / "ca.pem")

    def service_flags(self, service: str) -> list[str]:
        """A service's `--tls-*` flags and its `--join-token-file` (a path: the token never shows in `ps`)."""
        return [*self.files(service).as_flags(), "--join-token-file", str(self.join_token)]

    def client(self) -> TlsFiles:
        return self.files("client")


def wait_serving(address: str, children: list[tuple[str, Popen]], timeout_s: float, log_dir: Path,
                 tls: TlsFiles | None = None) -> None:  # fmt: skip
    """Poll grpc.health.v1 until SERVING; fail at once, with the log tail, if any child exits. `tls`: a client
    certificate for a server that runs mutual TLS (health needs no token, but the handshake needs a certificate)."""
    deadline = time.monotonic() + timeout_s
    with connect(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            for name, p in children:
                if p.poll() is not None:
                    tail = procs.tail(log_dir / f"{name}.log")
                    raise RuntimeError(f"{name} exited with code {p.returncode} during start-up:\n{tail}")
            with contextlib.suppress(grpc.RpcError):  # not listening yet
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == SERVING:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f} s; logs in {log_dir}")
            time.sleep(0.2)


@dataclass
class LocalMesh:
    """The processes of one local mesh, in start order."""

    log_dir: Path
    tls: MeshTls | None = None  # `up --tls`: the material every service and client uses
    join_token: Path | None = None  # without --tls: a join token file every service is given (a manifest's)
    gateway: str = ""  # host:port
    coordinator: str = ""
    http: str = ""  # host:port of the gateway's OpenAI-compatible HTTP API, as a client on this host reaches it
    share: CoreShare | None = None
    # host:port of the coordinator's and the gateway's /metrics (with --metrics); the workers' are in the topology
    metrics: dict[str, str] = field(default_factory=dict)
    children: list[tuple[str, Popen]] = field(default_factory=list)
    _files: list = field(default_factory=list)

    commands: dict[str, tuple[list[str], dict[str, str] | None]] = field(default_factory=dict)
    worker_restart_delay: float = 0.0  # seconds; set when spares cover a dead worker's slot (`supervise_once`)
    restart_due: dict[str, float] = field(default_factory=dict)  # dead worker -> when it is restarted

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Popen:
        f = (self.log_dir / f"{name}.log").open("ab")
        self._files.append(f)
        p = procs.spawn(["-m", "shardmesh_cli", *args], env=env, stderr=f, stdout=f)
        self.commands[name] = (args, env)
        names = [n for n, _ in self.children]
        if name in names:  # a restart keeps its place, so stop() still stops the gateway first, the coordinator last
            self.children[names.index(name)] = (name, p)
        else:
            self.children.append((name, p))
        return p

    def respawn(self, name: str) -> Popen:
        args, env = self.commands[name]
        return self.spawn(name, args, env)

    def stop(self) -> None:
        # Gateway first (it stops taking requests), then workers, then the coordinator.
        procs.stop_all([p for _, p in reversed(self.children)])
        for f in self._files:
            f.close()

    @property
    def client_tls(self) -> TlsFiles | None:
        return self.tls.client() if self.tls is not None else None

    def security_flags(self, service: str) -> list[str]:
        if self.tls is not None:
            return self.tls.service_flags(service)
        return ["--join-token-file", str(self.join_token)] if self.join_token is not None else []


def _otlp_flags(args: argparse.Namespace) -> list[str]:
    """Every service sends its spans to the same OTLP endpoint."""
    return ["--otlp-endpoint", args.otlp_endpoint] if getattr(args, "otlp_endpoint", None) else []


def _reachable(host: str) -> str:
    """A host to print for a server bound to `host`: a wildcard address is reached on loopback here."""
    host = host.strip("[]")
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def _metrics_flags(mesh: LocalMesh, service: str, listen: str) -> list[str]:
    """`--metrics-port` for the coordinator or the gateway under `up --metrics`: a port chosen here, so that
    `up` can print where it is (workers take any free port and publish it in the topology instead)."""
    port = free_port()
    mesh.metrics[service] = f"{_reachable(listen.rpartition(':')[0])}:{port}"
    return ["--metrics-port", str(port)]


def _http_flags(mesh: LocalMesh, args: argparse.Namespace) -> list[str]:
    """The gateway's OpenAI-compatible API: on unless `--no-http`, at `--http-listen` or a free loopback port (a
    port chosen here, like the gateway's own, so that `up` can print it); the model's name for clients,
    `--served-model-name` or the `--model` as given, either way."""
    # The name clients see (metrics' model_name label and spans too), with or without HTTP: the resolved directory
    # the coordinator was given means nothing to them.
    served = ["--served-model-name", str(getattr(args, "served_model_name", None) or args.model)]
    if getattr(args, "no_http", False):
        return served
    listen = getattr(args, "http_listen", None) or "127.0.0.1:0"
    host, _, port = listen.rpartition(":")
    if int(port) == 0:
        listen = f"{host}:{free_port()}"
    mesh.http = f"{_reachable(host)}:{listen.rpartition(':')[2]}"
    return ["--http-listen", listen, *served]


def http_url(address: str, tls: bool = False) -> str:
    """The base URL OpenAI clients take (`base_url`), for an HTTP API at host:port (HTTPS with `tls`)."""
    return f"{'https' if tls else 'http'}://{address}/v1"


def _balance_flags(args: argparse.Namespace) -> list[str]:
    """The coordinator's layer split, node pinning and balance check, as `up` (or its manifest) sets them."""
    flags = ["--max-stage-ratio", f"{getattr(args, 'max_stage_ratio', 1.25):g}",
             "--rebalance", getattr(args, "rebalance", "none")]  # fmt: skip
    if getattr(args, "require_balance", False):
        flags.append("--require-balance")
    if getattr(args, "layers", None):
        flags += ["--layers", args.layers]
    if getattr(args, "rank_nodes", None):
        flags += ["--rank-nodes", args.rank_nodes]
    return flags


def _intermediate_size(model_dir: Path) -> int:
    """The model's intermediate_size, for `uneven_ranks`; 0 (no uneven split) where its config cannot be read here
    (the coordinator reads it next, and says what is wrong with it)."""
    try:
        return ModelConfig.from_dir(model_dir).intermediate_size
    except (OSError, ValueError):
        return 0


def pinned_nodes(pp: int, tp: int, rank_cpus: Sequence[int]) -> str:
    """The coordinator's --rank-nodes for ranks pinned to CPUs (`worker_commands`' `cpu<N>` labels)."""
    return ",".join(f"cpu{rank_cpus[rank % tp]}" for rank in range(pp * tp))


def worker_devices(args: argparse.Namespace, visible_gpus: int | None = None) -> list[str]:
    """The `--device` of every worker `worker_commands` starts: one per global rank (`assign_devices`: each rank on
    a GPU of its own with `--device cuda`), then one per spare (a GPU no rank uses). `visible_gpus`: None asks
    torch, only when `--device` names a GPU. Raises ValueError naming the flag and the counts."""
    from shardmesh.core import device_map

    if visible_gpus is None:
        visible_gpus = device_map.visible_gpus_for(args.device)
    ranks = device_map.assign_devices(args.device, args.pp, args.tp, visible_gpus)
    return ranks + device_map.spare_devices(ranks, getattr(args, "spares", 0), visible_gpus)


def worker_commands(args: argparse.Namespace, coordinator: str, security: Sequence[str] = (),
                    devices: Sequence[str] | None = None,
                    rank_cpus: Sequence[int] = ()) -> list[tuple[str, list[str]]]:  # fmt: skip
    """(process name, `shardmesh` arguments) of every worker: the pp × tp stage workers, then `--spares` more.

    The spares get the ids after the stage workers' and the same flags; they register beyond the plan, so the
    coordinator keeps them as hot spares for a slot that is lost or drained. `security`: the workers' TLS and join
    token flags (`MeshTls.service_flags`). `devices`: each worker's `--device` (default: `worker_devices`).
    `rank_cpus`: the CPU of each stage's tp rank t (`CoreShare.rank_cpus`): worker r gets `--cpus` and the node label
    `cpu<N>` that `pinned_nodes` asks the coordinator to place rank r on.
    """
    world = args.pp * args.tp
    devices = worker_devices(args) if devices is None else devices
    nodes = args.rank_nodes.split(",") if getattr(args, "rank_nodes", None) else None
    telemetry = _otlp_flags(args)
    # -1: any free port, published in the topology, so a restarted worker binds a fresh one and
    # `shardmesh top` still finds it
    worker_metrics = ["--metrics-port", "-1"] if getattr(args, "metrics", False) else []
    budget = ["--memory-budget", args.memory_budget] if getattr(args, "memory_budget", None) else []
    out = []
    for rank in range(world + getattr(args, "spares", 0)):
        # the node the plan put this rank on; a spare is on no node of the plan, so it gets no label
        labels = ["--label", f"node={nodes[rank]}"] if nodes and rank < world else []
        if rank_cpus and rank < world:
            cpu = rank_cpus[rank % args.tp]
            labels = ["--label", f"node=cpu{cpu}", "--cpus", str(cpu)]
        out.append((f"worker{rank}", ["worker", "--coordinator", coordinator, "--worker-id", f"worker-{rank}",
                                      "--device", devices[rank], *labels, *telemetry, *worker_metrics,
                                      *security, *budget]))  # fmt: skip
    return out


def start_mesh(args: argparse.Namespace, model_dir: Path) -> LocalMesh:
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="shardmesh-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # With a spare to take a dead worker's slot, its restart need not compete with the recovery for the cores.
    mesh = LocalMesh(log_dir, worker_restart_delay=SPARE_RESTART_DELAY_S if getattr(args, "spares", 0) else 0.0)
    join_token = Path(args.join_token_file) if getattr(args, "join_token_file", None) else None
    if getattr(args, "tls", False):
        directory = Path(args.tls_dir) if getattr(args, "tls_dir", None) else log_dir / "tls"
        mesh.tls, made = MeshTls.ensure(directory, join_token)
        print(f"tls: {'made' if made else 'reusing'} a CA, certificates and a join token in {directory}",
              file=sys.stderr, flush=True)  # fmt: skip
    else:
        mesh.join_token = join_token
    try:
        mesh.coordinator = getattr(args, "coordinator_listen", None) or f"127.0.0.1:{free_port()}"
        # A fixed store port (the manifest's services.coordinator.store_port, or one chosen now), like the fixed
        # --listen: a coordinator the supervisor restarts serves the rendezvous store where the workers know it.
        store_port = getattr(args, "store_port", None) or free_port()
        coord = ["coordinator", "--listen", mesh.coordinator, "--model", str(model_dir), "--pp", str(args.pp),
                 "--tp", str(args.tp), "--dtype", args.dtype, "--kv-slots", str(args.kv_slots),
                 "--store-port", str(store_port)]  # fmt: skip
        if getattr(args, "quantize", "none") != "none":
            coord += ["--quantize", args.quantize]
        if args.max_context:
            coord += ["--max-context", str(args.max_context)]
        if args.max_batch_tokens:
            coord += ["--max-batch-tokens", str(args.max_batch_tokens)]
        if getattr(args, "kv_block_size", 0):
            coord += ["--kv-block-size", str(args.kv_block_size)]
        if getattr(args, "kv_cache_memory", None) is not None:
            coord += ["--kv-cache-memory", str(args.kv_cache_memory)]
        devices = worker_devices(args)  # checked by `cmd_up` already: a refusal there is a usage error
        # "auto" pins only a mesh whose every worker up places: no manifest's node plan, no spares (a spare has no
        # CPU of its own to take a pinned rank's slot with)
        asked_split = getattr(args, "tp_split", "auto")
        if asked_split == "auto" and (getattr(args, "rank_nodes", None) or getattr(args, "spares", 0)):
            asked_split = "even"
        share = share_cores(args.pp, args.tp, devices[: args.pp * args.tp], getattr(args, "pipeline", "auto"),
                            getattr(args, "worker_threads", None), procs.cores(),
                            priority=getattr(args, "compute_priority", "auto"), tp_split=asked_split,
                            intermediate_size=_intermediate_size(model_dir) if args.tp > 1 else 0,
                            cpu_ids=sorted(os.sched_getaffinity(0)))  # fmt: skip
        mesh.share = share
        if share.tp_split:
            coord += ["--tp-split", format_tp_split(share.tp_split)]
        coord += _balance_flags(args)
        if share.rank_cpus:
            coord += ["--rank-nodes", pinned_nodes(args.pp, args.tp, share.rank_cpus)]
        metrics = getattr(args, "metrics", False)
        telemetry = _otlp_flags(args)
        if metrics:
            coord += _metrics_flags(mesh, "coordinator", mesh.coordinator)
        mesh.spawn("coordinator", coord + telemetry + mesh.security_flags("coordinator"))
        wait_serving(mesh.coordinator, mesh.children, 60, log_dir, mesh.client_tls)
        env = {**os.environ, **share.worker_env, "OMP_NUM_THREADS": str(share.worker_threads)}
        for name, command in worker_commands(args, mesh.coordinator, mesh.security_flags("worker"), devices,
                                             share.rank_cpus):  # fmt: skip
            mesh.spawn(name, command, env=env)
        mesh.gateway = args.listen or f"127.0.0.1:{free_port()}"
        gateway = ["gateway", "--listen", mesh.gateway, "--coordinator", mesh.coordinator,
                   "--pipeline-depth", str(share.gateway_depth)]  # fmt: skip
        if getattr(args, "max_queue", None):  # from a manifest (serving.max_queue)
            gateway += ["--max-queue", str(args.max_queue)]
        if metrics:
            gateway += _metrics_flags(mesh, "gateway", mesh.gateway)
        gateway += _http_flags(mesh, args)
        if getattr(args, "api_key_file", None):
            gateway += ["--api-key-file", str(args.api_key_file)]
        # The API key goes by environment, never on a command line that `ps` shows.
        api_key = getattr(args, "api_key", None)
        mesh.spawn("gateway", gateway + telemetry + mesh.security_flags("gateway"),
                   env={**os.environ, API_KEY_ENV: api_key} if api_key else None)  # fmt: skip
        wait_serving(mesh.gateway, mesh.children, args.start_timeout, log_dir, mesh.client_tls)
        return mesh
    except BaseException:
        mesh.stop()
        raise


def _topology(coordinator: str, tls: TlsFiles | None = None) -> Topology | grpc.RpcError:
    """The coordinator's topology once the mesh serves, or why it could not be had."""
    from shardmesh_cli.status import fetch

    try:
        return fetch(coordinator, 5.0, tls)
    except grpc.RpcError as e:
        return e


def _balance_summary(coordinator: str, topology: Topology | grpc.RpcError, client_flags: str = "") -> str:
    """One line on the balance check the mesh passed before serving (details: `shardmesh status`)."""
    if isinstance(topology, grpc.RpcError):
        return f"balance check: could not ask the coordinator ({topology.code().name})"
    c = topology.calibration
    return (f"balance check {c.status.value}: {c.message} (details: shardmesh status --coordinator "
            f"{coordinator}{client_flags})")  # fmt: skip


def client_flags(tls: TlsFiles | None) -> str:
    """The flags a tool needs against a mesh of `up --tls` (" --tls-cert ... --tls-key ... --tls-ca ..."), or ""."""
    return "" if tls is None else " " + " ".join(tls.as_flags())


def metrics_endpoints(services: Mapping[str, str], topology: Topology | grpc.RpcError) -> list[tuple[str, str]]:
    """(name, host:port) of every /metrics: the gateway, the coordinator, then each worker from the topology
    (its `metrics` label), named by worker id and shard; an address is "" where it is not known."""
    from shardmesh.rpc.telemetry import METRICS_LABEL

    out = [(name, services[name]) for name in ("gateway", "coordinator") if name in services]
    if isinstance(topology, Topology):
        out += [(f"{shard.worker_id} (stage {stage.index}, tp rank {shard.tp_rank})", shard.label(METRICS_LABEL))
                for stage, shard in topology.shards() if not shard.vacant]  # fmt: skip
    return out


def metrics_lines(coordinator: str, endpoints: Sequence[tuple[str, str]]) -> list[str]:
    """The lines `up --metrics` prints: one per Prometheus endpoint, then the `shardmesh top` command that
    watches them all (the coordinator lists the workers; only the gateway's address must be given)."""
    width = max((len(name) for name, _ in endpoints), default=0)
    lines = [f"metrics: {name:<{width}}  " + (f"http://{address}/metrics" if address else "(not published)")
             for name, address in endpoints]  # fmt: skip
    gateway = dict(endpoints).get("gateway")
    watch = f"shardmesh top --coordinator {coordinator}" + (f" --gateway-metrics {gateway}" if gateway else "")
    return [*lines, f"watch the mesh: {watch}"]


def supervise_once(mesh: LocalMesh, restarts: dict[str, int], max_restarts: int,
                   now: float | None = None) -> int | None:  # fmt: skip
    """One look at the children: None while the mesh goes on, else `up`'s exit status.

    A worker that exited with status 0 was drained (`shardmesh drain`): its slot has moved, so it stays gone.
    A worker or the coordinator that died otherwise is started again with the same command (a worker keeps its
    id and takes its slot back; the coordinator keeps its address and store port, and the workers register with
    it again), up to `max_restarts` times each. Any other death, the gateway's included, ends the mesh.

    With spares, a dead worker is restarted `mesh.worker_restart_delay` seconds after its death was noticed: a
    spare has its slot by then, and a process starting (imports, its registration) on the cores the recovering
    mesh shares would slow the replay every running request is waiting for.
    """
    now = time.monotonic() if now is None else now
    for name, p in list(mesh.children):
        if p.poll() is None:
            continue
        is_worker = name.startswith("worker")
        if is_worker and p.returncode == 0:
            print(f"{name} drained and exited (status 0); not restarting it", file=sys.stderr, flush=True)
            mesh.children.remove((name, p))
            continue
        if (is_worker or name == "coordinator") and restarts.get(name, 0) < max_restarts:
            if is_worker and mesh.worker_restart_delay > 0:
                due = mesh.restart_due.setdefault(name, now + mesh.worker_restart_delay)
                if now < due:
                    continue
                del mesh.restart_due[name]
            restarts[name] = restarts.get(name, 0) + 1
            print(f"{name} exited with code {p.returncode}; restarting it ({restarts[name]}/{max_restarts})",
                  file=sys.stderr, flush=True)  # fmt: skip
            mesh.respawn(name)
            continue
        print(f"error: {name} exited with code {p.returncode}; logs in {mesh.log_dir}", file=sys.stderr)
        return 1
    return None


def _supervise(mesh: LocalMesh, max_restarts: int, sleep: Callable[[float], None] = time.sleep) -> int:
    """Watch the children until one dies for good (see `supervise_once`)."""
    restarts: dict[str, int] = {}
    while True:
        sleep(0.5)
        status = supervise_once(mesh, restarts, max_restarts)
        if status is not None:
            return status


def _workers_phrase(args: argparse.Namespace) -> str:
    """The workers in the start-up line, e.g. "4 stage workers (pp=2, tp=2) + 1 spare"."""
    spares = getattr(args, "spares", 0)
    extra = f" + {spares} spare{'s' if spares > 1 else ''}" if spares else ""
    return f"{args.pp * args.tp} stage workers (pp={args.pp}, tp={args.tp}){extra}"


def run(args: argparse.Namespace, model_dir: Path, demo: object | None = None) -> int:
    """Start the mesh, print where it listens, serve until a signal (or run `demo` and stop)."""
    with procs.terminate_on_signals():
        mesh = None
        try:
            t0 = time.monotonic()
            print(f"starting coordinator, {_workers_phrase(args)} and gateway for {model_dir} ...", file=sys.stderr,
                  flush=True)  # fmt: skip
            mesh = start_mesh(args, model_dir)
            secure = mesh.tls is not None
            http = f", OpenAI-compatible API at {http_url(mesh.http, secure)}" if mesh.http else ""
            print(f"gateway listening on {mesh.gateway}, coordinator on {mesh.coordinator}{http} (ready in "
                  f"{time.monotonic() - t0:.1f} s; logs in {mesh.log_dir})", file=sys.stderr, flush=True)  # fmt: skip
            topology = _topology(mesh.coordinator, mesh.client_tls)
            tool_flags = client_flags(mesh.client_tls)
            if mesh.metrics:
                for line in metrics_lines(mesh.coordinator, metrics_endpoints(mesh.metrics, topology)):
                    print(line + (tool_flags if line.startswith("watch the mesh") else ""), file=sys.stderr,
                          flush=True)  # fmt: skip
            print(_balance_summary(mesh.coordinator, topology, tool_flags), file=sys.stderr, flush=True)
            if mesh.tls is not None:
                print(f"tls: mutual TLS on every gRPC hop, HTTPS on the HTTP API (CA {mesh.tls.directory}/ca.pem); "
                      f"tools take{tool_flags}; drain also --join-token-file {mesh.tls.join_token}", file=sys.stderr,
                      flush=True)  # fmt: skip
            if mesh.share is not None and (args.pp > 1 or mesh.share.compute_priority == "realtime"
                                           or mesh.share.priority_refused or mesh.share.rank_cpus):  # fmt: skip
                print(mesh.share.describe(procs.cores(), args.pp), file=sys.stderr, flush=True)
            if callable(demo):
                credentials = {} if mesh.client_tls is None else {
                    "tls_cert": str(mesh.client_tls.cert), "tls_key": str(mesh.client_tls.key),
                    "tls_ca": str(mesh.client_tls.ca)}  # fmt: skip
                return int(demo(mesh.gateway, api_key=getattr(args, "api_key", None),
                                api_key_file=getattr(args, "api_key_file", None), **credentials) or 0)  # fmt: skip
            print(mesh.gateway, flush=True)  # stdout carries the addresses, for scripts: the gateway's first,
            print(f"coordinator: {mesh.coordinator}", flush=True)  # then the coordinator's (status, top, drain)
            if mesh.http:  # then the OpenAI-compatible API's base URL
                print(f"http: {http_url(mesh.http, secure)}", flush=True)
            return _supervise(mesh, args.max_restarts)
        except KeyboardInterrupt:
            print("stopping the mesh ...", file=sys.stderr, flush=True)
            return 0
        finally:
            if mesh is not None:
                mesh.stop()


# --- `up --manifest FILE`: the manifest mapped onto the flags above (see shardmesh/planning/deploy.py) ---

# up's flags that a manifest sets, and where; giving one as well is refused rather than silently overridden.
MANIFEST_FLAGS = {
    "model": "model.path", "pp": "parallelism.pipeline", "tp": "parallelism.tensor", "dtype": "model.dtype",
    "device": "services.worker.device", "listen": "services.gateway.listen", "kv_slots": "serving.kv_slots",
    "max_context": "serving.max_context", "max_batch_tokens": "serving.max_batch_tokens",
    "layers": "the plan (nodes)", "rebalance": "placement.rebalance", "max_stage_ratio": "placement.max_stage_ratio",
    "require_balance": "placement.require_balance", "http_listen": "services.gateway.http_listen",
    "no_http": "services.gateway.http_listen", "served_model_name": "model.served_model_name",
    "quantize": "model.quantization", "memory_budget": "services.worker.memory_budget",
    "kv_block_size": "serving.kv_block_size", "kv_cache_memory": "serving.kv_cache_memory",
    "tp_split": "parallelism.tensor_split.shares",
}  # fmt: skip


def args_from_manifest(args: argparse.Namespace, defaults: dict[str, object]) -> tuple[argparse.Namespace, list[str]]:
    """`args` with every field the manifest at `args.manifest` sets, and notes on how it was planned.

    Raises `ManifestError` (one line per problem) or `PlanError` (the nodes cannot hold the model).
    """
    from shardmesh.planning import deploy
    from shardmesh.planning.manifest import ManifestError, load_manifest

    source = Path(args.manifest)
    given = [k for k in MANIFEST_FLAGS if getattr(args, k, None) != defaults.get(k)]
    if given:
        raise ManifestError(str(source), [f"--{k.replace('_', '-')}: the manifest sets this ({MANIFEST_FLAGS[k]})"
                                          for k in given])  # fmt: skip
    d = deploy.resolve(load_manifest(source), source)
    sec = d.manifest.services.security
    clash = [f for f, v in (("--tls-dir", sec.tls_dir), ("--api-key-file", sec.api_key_file))
             if v and getattr(args, f[2:].replace("-", "_"), None)]  # fmt: skip
    if clash:
        raise ManifestError(str(source), [f"{f}: the manifest sets this (services.security)" for f in clash])
    lim = d.limits
    kv = (f"{lim.kv_blocks} KV blocks × {lim.kv_block_size} tokens, {lim.kv_slots} sequences" if lim.paged
          else f"{lim.kv_slots} KV slots × {lim.max_context} tokens")  # fmt: skip
    notes = [f"manifest {source}: pp={d.pp} × tp={d.tp}, {d.dtype}, {kv}", *d.notes]
    if d.plan is not None:
        notes.append(f"planned layer split {layer_counts(d.plan.layer_split)} (layers per stage), ranks on nodes "
                     f"{[d.node_of(r) for r in range(d.pp * d.tp)]}; tightest device keeps "
                     f"{d.plan.min_headroom / 2**30:.2f} GiB free")  # fmt: skip
    out = deploy.up_args(d, args)
    if d.plan is not None and out.device == "cuda":  # `up_device`: a plan over several nodes, run on this one host
        notes.append("the plan spans several nodes; on this one host every rank takes a GPU of its own in rank "
                     "order (cuda:0, cuda:1, ...)")  # fmt: skip
    gateway = d.manifest.services.gateway
    out.http_listen, out.no_http = gateway.http_listen, gateway.http_listen is None  # port 0: `up` picks a free one
    out.served_model_name = d.manifest.model.served_model_name or d.manifest.model.path  # the name as written
    return out, notes
