"""deploy/k8s/, without a cluster: every object against Kubernetes' own schemas, and every service as it would run.

- Every manifest, and the Secrets the kustomization generates, pass the OpenAPI schemas of Kubernetes 1.25 and 1.37
  (`kubernetes-validate`, strict: an unknown field is an error), for the CPU and the CUDA variant.
- Every `shardmesh` flag and SHARDMESH_* variable the containers use exists in the CLI's parser; each service's
  command line, with its environment and Kubernetes' `$(VAR)` expansion, parses and passes the service's own checks
  (`build_config`), TLS files included: the Secrets are made from what `shardmesh certs init` writes, mounted where
  the pods mount them.
- The services are wired to each other (addresses, ports, the rendezvous store, the workers' names under their
  headless Service and the names on their certificates), the workers are a StatefulSet that `kubectl scale` resizes
  (with a GPU each in the CUDA variant), the probes ask grpc.health.v1 on each service's own port, and the network
  policies keep the workers' ports and the store inside the mesh.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.checkpoints import SMOLLM2_CONFIG
from tests.e2e.conftest import cli_surface

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VARIANTS = ("cpu", "cuda")
SUBCOMMANDS = ("coordinator", "worker", "gateway")
KUBERNETES_VERSIONS = ("1.25", "1.37")  # the oldest and the newest schemas kubernetes-validate ships
GLOBAL_ENV = {"SHARDMESH_LOG_LEVEL"}  # read by every service (shardmesh/rpc/log.py)
OTHER_ENV = {"POD_NAME", "POD_NAMESPACE", "POD_IP", "OMP_NUM_THREADS", "HOME"}  # the pods' own, not shardmesh flags
FIELDS = {"metadata.name": "shardmesh-worker-0", "metadata.namespace": "shardmesh", "status.podIP": "10.1.2.3"}
HEALTHCHECK = "shardmesh-healthcheck"


# -- the objects ---------------------------------------------------------------------------------------------------


def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def resources(directory: Path) -> list[dict[str, Any]]:
    """The objects a kustomization directory lists, its bases' included (Secrets from generators are not here)."""
    out = []
    for entry in kustomization(directory)["resources"]:
        path = (directory / entry).resolve()
        if path.is_dir():
            out += resources(path)
        else:
            out += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def objects(variant: str) -> list[dict[str, Any]]:
    return resources(K8S / variant)


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def pod_of(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def container_of(obj: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_of(obj)["containers"]
    return container


def workloads(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The coordinator, worker and gateway workloads, by the subcommand their container runs."""
    out = {}
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            out[container_of(obj)["args"][0]] = obj
    assert set(out) == set(SUBCOMMANDS)
    return out


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A secrets/ directory as secrets/README.md makes it: `shardmesh certs init` with the cluster's names, and the
    two token files."""
    secrets = tmp_path_factory.mktemp("secrets")
    hosts = ["shardmesh-coordinator", "shardmesh-coordinator.shardmesh.svc",
             "*.shardmesh-worker.shardmesh.svc.cluster.local", "shardmesh-gateway",
             "shardmesh-gateway.shardmesh.svc"]  # fmt: skip
    command = [sys.executable, "-m", "shardmesh_cli", "certs", "init", str(secrets / "tls")]
    made = subprocess.run([*command, *[a for h in hosts for a in ("--host", h)]], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert made.returncode == 0, made.stderr
    (secrets / "join-token").write_text("a-join-token\n")
    (secrets / "api-keys").write_text("# clients\nkey-one\n")
    return secrets


def generated_secrets(certs: Path) -> dict[str, dict[str, bytes]]:
    """The Secrets the base's secretGenerator makes, as {name: {key: content}}, from `certs` in place of secrets/."""
    base = kustomization(K8S / "base")
    assert base["generatorOptions"]["disableNameSuffixHash"] is True, "fixed names: Secrets are updated in place"
    out = {}
    for generator in base["secretGenerator"]:
        data = {}
        for item in generator["files"]:
            key, _, source = item.partition("=")
            assert source.startswith("secrets/"), source
            data[key] = (certs / source.removeprefix("secrets/")).read_bytes()
        out[generator["name"]] = data
    return out


def secret_objects(certs: Path) -> list[dict[str, Any]]:
    import base64

    return [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": "shardmesh"},
             "type": "Opaque", "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}
            for name, data in generated_secrets(certs).items()]  # fmt: skip


# -- Kubernetes' schemas --------------------------------------------------------------------------------------------


def validate(obj: dict[str, Any]) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_is_valid_kubernetes(variant: str, certs: Path) -> None:
    objs = objects(variant) + secret_objects(certs)
    for obj in objs:
        validate(obj)
    namespace = kustomization(K8S / variant)["namespace"]
    assert namespace == kustomization(K8S / "base")["namespace"]
    for obj in objs:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace, obj["metadata"]["name"]
    assert {o["kind"] for o in objs} >= {"Namespace", "Deployment", "StatefulSet", "Service", "NetworkPolicy",
                                         "PersistentVolumeClaim", "Secret"}  # fmt: skip


def test_the_schemas_refuse_a_broken_object() -> None:
    """The check above can fail: a misspelt field, a wrong type."""
    coordinator = find(objects("cpu"), "Deployment", "shardmesh-coordinator")
    misspelt = copy.deepcopy(coordinator)
    misspelt["spec"]["template"]["spec"]["containerz"] = misspelt["spec"]["template"]["spec"].pop("containers")
    wrong = copy.deepcopy(coordinator)
    wrong["spec"]["replicas"] = "one"
    for broken in (misspelt, wrong):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(broken)


# -- the CLI's surface --------------------------------------------------------------------------------------------


def surface_problems(objs: list[dict[str, Any]]) -> list[str]:
    """Flags and SHARDMESH_* variables the containers use that the CLI does not have."""
    surfaces = {sub: cli_surface(sub) for sub in SUBCOMMANDS}
    problems = []
    for sub, obj in workloads(objs).items():
        container = container_of(obj)
        options, env = surfaces[sub]
        flags = {t.split("=", 1)[0] for t in container["args"][1:] if t.startswith("-")}
        problems += [f"{sub}: `shardmesh {sub}` has no {f}" for f in sorted(flags - options)]
        names = {e["name"] for e in container.get("env", [])}
        unknown = {n for n in names if n.startswith("SHARDMESH_")} - env - GLOBAL_ENV
        problems += [f"{sub}: `shardmesh {sub}` reads no {n}" for n in sorted(unknown)]
        problems += [f"{sub}: {n} is neither a shardmesh variable nor one of the pod's" for n in
                     sorted(n for n in names - OTHER_ENV if not n.startswith("SHARDMESH_"))]  # fmt: skip
    return problems


@pytest.mark.parametrize("variant", VARIANTS)
def test_flags_and_variables_exist_in_the_cli(variant: str, clean_env: pytest.MonkeyPatch) -> None:
    assert surface_problems(objects(variant)) == []


def test_an_unknown_flag_or_variable_is_caught(clean_env: pytest.MonkeyPatch) -> None:
    objs = objects("cpu")
    gateway = container_of(find(objs, "Deployment", "shardmesh-gateway"))
    gateway["args"] += ["--max-mesage-bytes", "1"]
    gateway["env"].append({"name": "SHARDMESH_GATEWAY_API_KEYFILE", "value": "x"})
    assert surface_problems(objs) == [
        "gateway: `shardmesh gateway` has no --max-mesage-bytes",
        "gateway: `shardmesh gateway` reads no SHARDMESH_GATEWAY_API_KEYFILE",
    ]


def test_probes_use_flags_the_health_check_has() -> None:
    helped = subprocess.run([sys.executable, str(ROOT / "compose" / "healthcheck.py"), "--help"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    options = set(re.findall(r"(--[a-z-]+)", helped.stdout))
    for variant in VARIANTS:
        for obj in workloads(objects(variant)).values():
            container = container_of(obj)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = container[probe]["exec"]["command"]
                assert command[0] == HEALTHCHECK, command
                assert {c for c in command[1:] if c.startswith("--")} <= options, command


# -- each service as it would run ------------------------------------------------------------------------------------


def expanded(value: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of a container's args, from the container's own variables."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def container_env(container: dict[str, Any]) -> dict[str, str]:
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = FIELDS[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:  # resourceFieldRef
            ref = e["valueFrom"]["resourceFieldRef"]
            env[e["name"]] = str(container["resources"][ref["resource"].split(".")[0]][ref["resource"].split(".")[1]])
    return env


def mounted(obj: dict[str, Any], secrets: dict[str, dict[str, bytes]], where: Path) -> dict[str, Path]:
    """The pod's Secret volumes written out under `where`, as {mountPath: directory}."""
    volumes = {v["name"]: v for v in pod_of(obj)["volumes"]}
    out = {}
    for mount in container_of(obj)["volumeMounts"]:
        volume = volumes[mount["name"]]
        assert "subPath" not in mount, f"{mount['name']}: a subPath mount never sees a Secret's updates"
        if "secret" not in volume:
            continue
        directory = where / volume["secret"]["secretName"]
        directory.mkdir(parents=True, exist_ok=True)
        for key, content in secrets[volume["secret"]["secretName"]].items():
            (directory / key).write_bytes(content)
        out[mount["mountPath"]] = directory
    return out


def run_as(obj: dict[str, Any], secrets: dict[str, dict[str, bytes]], where: Path, model: Path,
           monkeypatch: pytest.MonkeyPatch) -> tuple[argparse.Namespace, Any, dict[str, str]]:  # fmt: skip
    """(parsed args, the service's config from its `build_config`, its environment), as the pod runs it: args
    expanded, the Secrets mounted (under `where`), the model volume pointing at `model`."""
    container = container_of(obj)
    env = container_env(container)
    mounts = mounted(obj, secrets, where)
    model_mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "model")

    def local(value: str) -> str:
        for path, directory in mounts.items():
            value = value.replace(path, str(directory))
        return value.replace(model_mount, str(model))

    argv = [local(expanded(a, env)) for a in container["args"]]
    with monkeypatch.context() as m:
        for key, value in env.items():
            m.setenv(key, local(value))
        from shardmesh_cli.main import build_parser

        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"`shardmesh {shlex.join(argv)}` does not parse")
        app = {"coordinator": "coordinator.app", "worker": "shardworker.app", "gateway": "gateway.app"}[args.command]
        config = __import__(app, fromlist=["build_config"]).build_config(args)
    return args, config, env


def model_volume(where: Path, coordinator: dict[str, Any]) -> Path:
    """A stand-in for the model volume, holding SmolLM2's config.json where the coordinator's --model points."""
    container = container_of(coordinator)
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "model")
    model = container["args"][container["args"].index("--model") + 1]
    assert model.startswith(mount + "/"), "the model is read from the model volume"
    directory = where / "volume" / model.removeprefix(mount + "/")
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    return where / "volume"


def port_of(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def service_port(service: dict[str, Any], workload: dict[str, Any], name: str) -> tuple[int, int]:
    """(the Service's port named `name`, the container port it targets)."""
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == name]
    (target,) = [p for p in container_of(workload)["ports"] if p["name"] == port["targetPort"]]
    return port["port"], target["containerPort"]


@pytest.fixture
def running(variant: str, certs: Path, tmp_path: Path, clean_env: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    objs = objects(variant)
    secrets = generated_secrets(certs)
    model = model_volume(tmp_path, workloads(objs)["coordinator"])
    yield {sub: run_as(obj, secrets, tmp_path / sub, model, clean_env) for sub, obj in workloads(objs).items()} | {
        "objects": objs}  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_parse_and_fit_together(variant: str, running: dict[str, Any]) -> None:
    objs = running["objects"]
    work = workloads(objs)
    c_args, c_cfg, _ = running["coordinator"]
    w_args, w_cfg, w_env = running["worker"]
    g_args, g_cfg, _ = running["gateway"]

    # The coordinator: SmolLM2 2 × 1; its store at its own pod address, on the fixed port the policies name.
    assert (c_cfg.pp, c_cfg.tp) == (2, 1) and c_cfg.store_host == FIELDS["status.podIP"]
    assert c_cfg.store_port == 29500
    coordinator_service = find(objs, "Service", "shardmesh-coordinator")
    port, target = service_port(coordinator_service, work["coordinator"], "grpc")
    assert target == port_of(c_args.listen) and c_args.listen.startswith("0.0.0.0:")
    assert coordinator_service["spec"]["selector"] == work["coordinator"]["spec"]["selector"]["matchLabels"]
    coordinator_address = f"{coordinator_service['metadata']['name']}:{port}"
    assert work["coordinator"]["spec"]["replicas"] == 1, "one coordinator publishes the topology"
    assert work["coordinator"]["spec"]["strategy"]["type"] == "Recreate"

    # Workers: a StatefulSet (resized by `kubectl scale`) behind a headless Service that publishes pods before they
    # are ready; each dials the coordinator, is named after its pod, and advertises its own DNS name and port.
    statefulset = work["worker"]
    assert statefulset["kind"] == "StatefulSet" and statefulset["spec"]["podManagementPolicy"] == "Parallel"
    assert statefulset["spec"]["replicas"] >= c_cfg.pp * c_cfg.tp
    headless = find(objs, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"] == statefulset["spec"]["selector"]["matchLabels"]
    assert w_args.coordinator == coordinator_address and w_args.worker_id == FIELDS["metadata.name"]
    advertised = f"{FIELDS['metadata.name']}.{headless['metadata']['name']}.{FIELDS['metadata.namespace']}" \
                 f".svc.cluster.local:{port_of(w_args.listen)}"  # fmt: skip
    assert w_args.advertise == advertised
    assert service_port(headless, statefulset, "grpc")[1] == port_of(w_args.listen)
    resources = container_of(statefulset)["resources"]
    if variant == "cuda":
        assert w_args.device == "cuda" and container_of(statefulset)["image"].endswith(":cuda")
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    else:
        assert w_args.device == "cpu" and "nvidia.com/gpu" not in str(resources)
        assert w_env["OMP_NUM_THREADS"] == str(resources["limits"]["cpu"]), "torch's threads: the pod's cores"

    # The gateway: dials the coordinator, serves gRPC and HTTP through its Service, one replica.
    assert g_args.coordinator == coordinator_address
    gateway_service = find(objs, "Service", "shardmesh-gateway")
    assert service_port(gateway_service, work["gateway"], "grpc")[1] == port_of(g_args.listen)
    assert service_port(gateway_service, work["gateway"], "http")[1] == port_of(g_args.http_listen)
    assert g_cfg.served_model_name == "smollm2-135m-instruct"
    assert work["gateway"]["spec"]["replicas"] == 1, "the gateway owns the KV slots: one per mesh"

    # Every service runs mutual TLS with its own certificate and the join token; the gateway asks for API keys. The
    # model is at the same path everywhere (the coordinator publishes it).
    for cfg in (c_cfg, w_cfg, g_cfg):
        assert cfg.tls is not None
    assert w_cfg.join_token == g_cfg.join_token == "a-join-token" and c_cfg.join_tokens is not None
    assert g_cfg.api_keys is not None and g_cfg.api_keys.check("Bearer key-one").name == "OK"
    assert c_args.model == g_args.model_dir


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_certificates_name_what_each_service_is_dialled_at(variant: str, running: dict[str, Any],
                                                               certs: Path) -> None:  # fmt: skip
    """A client checks the name it dials against the server's certificate: the coordinator's Service, each worker's
    advertised name (a wildcard covers every pod), the gateway's Service, and 127.0.0.1 for the probes."""
    from cryptography import x509

    secrets = generated_secrets(certs)
    volumes = {sub: next(v["secret"]["secretName"] for v in pod_of(obj)["volumes"] if v["name"] == "tls")
               for sub, obj in workloads(running["objects"]).items()}  # fmt: skip
    dialled = {"coordinator": running["worker"][0].coordinator, "worker": running["worker"][0].advertise,
               "gateway": f"shardmesh-gateway:{port_of(running['gateway'][0].listen)}"}  # fmt: skip
    for sub, address in dialled.items():
        cert = x509.load_pem_x509_certificate(secrets[volumes[sub]]["cert.pem"])
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = names.get_values_for_type(x509.DNSName)
        host = address.rpartition(":")[0]
        assert host in dns or any(n.startswith("*.") and host.partition(".")[2] == n[2:] for n in dns), (sub, dns)
        assert "127.0.0.1" in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
        assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == sub
    assert all(b"PRIVATE KEY" not in content for data in secrets.values() for k, content in data.items()
               if k != "key.pem"), "the CA's key stays out of the cluster"  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_ask_each_service_on_its_own_port(variant: str, running: dict[str, Any]) -> None:
    for sub, obj in workloads(running["objects"]).items():
        args = running[sub][0]
        container = container_of(obj)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = container[probe]["exec"]["command"]
            (address,) = [c for c in command[1:] if not c.startswith("--")]
            assert address == f"127.0.0.1:{port_of(args.listen)}", (sub, probe)
            # A worker is alive but NOT_SERVING while it loads or waits as a spare; the gateway is ready only while a
            # complete mesh serves.
            alive = "--alive" in command
            assert alive == (sub == "worker" or (sub == "gateway" and probe != "readinessProbe")), (sub, probe)
        variables = {e["name"] for e in container["env"]}
        prefix = f"SHARDMESH_{sub.upper()}_TLS_"
        assert {prefix + f for f in ("CERT", "KEY", "CA")} <= variables, "the health check reads the TLS files there"


# -- the network policies -------------------------------------------------------------------------------------------


def components_allowed(objs: list[dict[str, Any]], component: str, port: int) -> set[str]:
    """Which components' pods the policies let reach `component`'s pods on `port` ("*": any source)."""
    allowed: set[str] = set()
    for policy in (o for o in objs if o["kind"] == "NetworkPolicy"):
        selector = policy["spec"]["podSelector"].get("matchLabels", {})
        if selector.get("app.kubernetes.io/component", component) != component:
            continue
        for rule in policy["spec"].get("ingress", []):
            ports = {p["port"] for p in rule.get("ports", [])}
            if ports and port not in ports:
                continue
            sources = rule.get("from")
            if not sources:
                allowed.add("*")
            for source in sources or []:
                labels = source.get("podSelector", {}).get("matchLabels")
                assert labels is not None and "namespaceSelector" not in source and "ipBlock" not in source, source
                allowed.add(labels["app.kubernetes.io/component"])
    return allowed


def test_the_data_plane_and_the_store_stay_inside_the_mesh() -> None:
    objs = objects("cpu")
    deny = find(objs, "NetworkPolicy", "shardmesh-default-deny")
    assert deny["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in deny["spec"]
    assert deny["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "shardmesh"}
    for obj in workloads(objs).values():
        assert obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "shardmesh"
    assert components_allowed(objs, "coordinator", 29500) == {"worker", "coordinator"}
    assert components_allowed(objs, "coordinator", 50051) == {"worker", "gateway"}
    assert components_allowed(objs, "worker", 50061) == {"gateway", "coordinator", "worker"}
    assert components_allowed(objs, "worker", 41234) == {"worker"}, "Gloo's and NCCL's ports: workers only"
    assert components_allowed(objs, "gateway", 50050) == components_allowed(objs, "gateway", 8000) == {"*"}
    assert components_allowed(objs, "gateway", 50061) == set()
