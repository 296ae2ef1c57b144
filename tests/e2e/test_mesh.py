"""The whole mesh over real processes on 127.0.0.1, driven by a client built only from `protos/`.

Stacks start the way users start them: `shardmesh up` as one process, or each service on its own
(as compose runs them) when a test needs to kill, restart or hold back one of them.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from shardmesh.proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2
from shardmesh.rpc import procs
from shardmesh_cli.up import free_port, wait_serving
from tests.checkpoints import make_checkpoint, reference_greedy
from tests.stack import Stack, worker_stubs

PROMPTS = [[1, 17, 5, 42, 33, 8], [1, 9, 9, 2, 60], [1, 70, 71], [1, 3, 5, 7, 11, 13, 17, 19]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # eos 95 is rare under this seed, so most answers run to max_new_tokens and compare many tokens.
    return make_checkpoint(tmp_path_factory.mktemp("e2e"), "llama-gqa-tied", num_layers=4, seed=11, eos_token_id=95)


@pytest.fixture(scope="module")
def reference(model: Path) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): reference_greedy(model, p, 12)[0] for p in PROMPTS}


class Up:
    """`shardmesh up` as a child process; the gateway address is the first line it prints."""

    def __init__(self, model: Path, pp: int, tp: int, log_dir: Path, *extra: str) -> None:
        args = ["-m", "shardmesh_cli", "up", "--model", str(model), "--pp", str(pp), "--tp", str(tp),
                "--log-dir", str(log_dir), *extra]  # fmt: skip
        self.proc = procs.spawn(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = self.proc.stdout.readline().decode().strip()
        if not line:
            raise RuntimeError(f"up failed: {self.proc.stderr.read().decode()[-3000:]}")
        self.address = line
        self.channel = grpc.insecure_channel(self.address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        procs.stop_all([self.proc], grace=15)


def greedy(ids: list[int], n: int = 12, **params) -> gateway_pb2.GenerateRequest:
    params_pb = gateway_pb2.SamplingParams(max_new_tokens=n, **{"temperature": 0.0, **params})
    return gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=ids), params=params_pb)


@pytest.fixture(scope="module", params=[(2, 1), (1, 2), (2, 2)], ids=lambda p: f"pp{p[0]}-tp{p[1]}")
def up(request, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    pp, tp = request.param
    u = Up(model, pp, tp, tmp_path_factory.mktemp(f"up{pp}{tp}"), "--kv-slots", "8", "--max-context", "128")
    yield u
    u.close()


def test_tp_ranks_outnumbering_the_cores_are_split_unevenly_and_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`up --tp 3` on two CPUs (its affinity narrowed to them here): ranks 0, 1, 2 hold 2, 1, 1 shares of the MLP and
    the vocabulary, each pinned to its CPU (0 alone on the first, 1 and 2 on the second), and the answers are still
    `transformers`' greedy ones."""
    import os

    # 6 heads over 3 ranks; intermediate_size 48: 3 even thirds, or 4 shares of 12 columns
    model = make_checkpoint(tmp_path / "m", "llama-gqa-tied", num_layers=2, seed=5, num_attention_heads=6,
                            num_key_value_heads=3, intermediate_size=48, eos_token_id=95)  # fmt: skip
    monkeypatch.setenv("SHARDMESH_LOG_LEVEL", "info")  # the workers' `ready` and `shard_loaded` lines
    cpus = sorted(os.sched_getaffinity(0))[:2]
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # this thread's, which the child inherits
    try:
        u = Up(model, 1, 3, tmp_path / "logs", "--kv-slots", "4", "--max-context", "64")
    finally:
        os.sched_setaffinity(0, mine)
    try:
        for prompt in PROMPTS[:2]:
            r = u.stub.Generate(greedy(prompt), timeout=60)
            want = reference_greedy(model, prompt, 12)[0]
            assert list(r.token_ids) == want[: len(r.token_ids)]
        events = {}
        for log in (tmp_path / "logs").glob("worker*.log"):
            lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
            ready = next(e for e in lines if e.get("event") == "ready")
            loaded = next(e for e in lines if e.get("event") == "shard_loaded")
            events[ready["tp_rank"]] = (os.sched_getaffinity(ready["pid"]), loaded["weights_bytes"])
    finally:
        u.close()
    if len(cpus) == 2:
        assert [events[r][0] for r in range(3)] == [{cpus[0]}, {cpus[1]}, {cpus[1]}]
        assert events[0][1] > events[1][1] == events[2][1]  # two shares of the MLP and the vocabulary against one
    else:  # one CPU: nothing to pin to; the split stays even
        assert events[0][1] == events[1][1] == events[2][1]


def test_unary_matches_transformers(up: Up, reference) -> None:
    import torch

    from tests.checkpoints import load_reference

    ref = load_reference(Path(up.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest()).model.path))
    for prompt in PROMPTS[:2]:
        r = up.stub.Generate(greedy(prompt), timeout=60)
        assert list(r.token_ids) == reference[tuple(prompt)][: len(r.token_ids)]
        assert r.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(r.token_ids)
        with torch.inference_mode():  # logprobs: score the whole sequence once with the reference
            seq = torch.tensor([prompt + list(r.token_ids)])
            lp = torch.log_softmax(ref(seq).logits[0].float(), -1)
        want = [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(r.token_ids)]
        assert max(abs(a - b) for a, b in zip(r.logprobs, want, strict=True)) < 1e-4


def test_sixteen_concurrent_streams(up: Up, reference) -> None:
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            prompt = PROMPTS[i % len(PROMPTS)]
            tokens, summary = [], None
            for msg in up.stub.GenerateStream(greedy(prompt), timeout=120):
                tokens.append(msg.token_id)
                if msg.HasField("summary"):
                    summary = msg.summary
            assert summary is not None and summary.usage.completion_tokens == len(tokens)
            results[i] = tokens
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors[0]
    for i, tokens in results.items():
        assert tokens == reference[tuple(PROMPTS[i % len(PROMPTS)])][: len(tokens)]
    assert len(results) == 16


@pytest.mark.parametrize(
    "request_pb,field",
    [
        (gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[])), "token_ids"),
        (gateway_pb2.GenerateRequest(prompt=""), "prompt"),
        (greedy([1, 2], n=500), "max_new_tokens"),
        (greedy([1, 2], n=0), "max_new_tokens"),
        (greedy([1] * 200), "token_ids"),
        (greedy([1], n=2, temperature=-1), "temperature"),
        (greedy([1], n=2, top_p=1.5), "top_p"),
        (greedy([1], n=2, top_p=0.0), "top_p"),
        (greedy([1, 96, 2]), "token_ids"),
    ],
)  # fmt: skip
def test_bad_input_is_invalid_argument_naming_the_field(up: Up, request_pb, field: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        up.stub.Generate(request_pb, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details()


def test_generate_cli_through_gateway_equals_offline(up: Up, model: Path) -> None:
    args = ["--token-ids", "1,17,5,42,33,8", "--max-new-tokens", "8", "--json"]
    via = subprocess.run([sys.executable, "-m", "shardmesh_cli", "generate", "--gateway", up.address, *args],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    offline = subprocess.run([sys.executable, "-m", "shardmesh_cli", "generate", "--model", str(model), *args],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert via.returncode == 0 and offline.returncode == 0, via.stderr + offline.stderr
    a, b = json.loads(via.stdout), json.loads(offline.stdout)
    assert a["token_ids"] == b["token_ids"] and a["finish_reason"] == b["finish_reason"]
    assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) < 1e-4


# --- services started one by one --------------------------------------------------------------------------


def start_gateway(stack: Stack, *extra: str) -> gateway_pb2_grpc.GatewayStub:
    address = f"127.0.0.1:{free_port()}"
    stack.spawn("gateway", "gateway", "--listen", address, "--coordinator", stack.coordinator, *extra)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # listening (it reports NOT_SERVING until the mesh is complete)
        try:
            grpc.channel_ready_future(grpc.insecure_channel(address)).result(timeout=1)
            break
        except grpc.FutureTimeoutError:
            continue
    stack.gateway_address = address  # type: ignore[attr-defined]
    return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))


def test_no_topology_then_cancel_then_lost_worker_resumed(model: Path, stack: Stack, reference) -> None:
    stack.start_coordinator(model, 2, 1, "--kv-slots", "2", "--max-context", "256")
    gw = start_gateway(stack, "--max-queue", "2", "--step-timeout", "30")

    # No workers yet: UNAVAILABLE, not a hang.
    with pytest.raises(grpc.RpcError) as e:
        gw.Generate(greedy([1, 2, 3]), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()

    stack.start_worker("a")
    stack.start_worker("b")
    topo = stack.wait_complete()
    wait_serving(stack.gateway_address, [], 60, stack.log_dir)  # type: ignore[attr-defined]

    # A client that cancels frees its KV slot on every stage.
    stream = gw.GenerateStream(greedy([1, 2, 3], n=100), timeout=60)
    next(stream)
    next(stream)
    stream.cancel()
    stubs = worker_stubs(topo)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        free = [s.GetShardInfo(worker_pb2.GetShardInfoRequest()).free_slots for s in stubs]
        if free == [2, 2]:
            break
        time.sleep(0.1)
    assert free == [2, 2], f"KV slots still held after cancel: {free}"

    # Queue full: 2 requests hold both slots (long answers), 2 wait, the next is RESOURCE_EXHAUSTED.
    held = [gw.GenerateStream(greedy([1, 2, 3], n=240), timeout=60) for _ in range(2)]
    for s in held:
        next(s)
    held += [gw.GenerateStream(greedy([1, 2, 3], n=240), timeout=60) for _ in range(2)]
    time.sleep(0.3)
    with pytest.raises(grpc.RpcError) as e:
        gw.Generate(greedy([1, 2]), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    for s in held:
        s.cancel()

    # A worker lost mid-request: the request waits without an error and, once the worker is back, replays
    # its log and finishes with the tokens of an undisturbed run; then new requests are served again.
    undisturbed = list(gw.Generate(greedy(PROMPTS[0], n=100), timeout=60).token_ids)
    stream = gw.GenerateStream(greedy(PROMPTS[0], n=100), timeout=120)
    first = next(stream)
    stack.kill("b")
    stack.start_worker("b")
    assert [first.token_id, *(m.token_id for m in stream)] == undisturbed
    assert '"event": "requests_resuming"' in (stack.log_dir / "gateway.log").read_text()  # it did resume
    stack.wait_complete(after_version=topo.version)
    wait_serving(stack.gateway_address, [], 60, stack.log_dir)  # type: ignore[attr-defined]
    r = gw.Generate(greedy(PROMPTS[0]), timeout=60)
    assert list(r.token_ids) == reference[tuple(PROMPTS[0])][: len(r.token_ids)]


def printed_metrics(u: Up) -> tuple[dict[str, str], list[str]]:
    """What `up --metrics` printed on stderr: {name: URL} of its `metrics:` lines, and the `shardmesh top`
    command line it suggests (the line after them)."""
    urls: dict[str, str] = {}
    while line := u.proc.stderr.readline().decode():
        if line.startswith("metrics: "):
            name, url = line.removeprefix("metrics: ").rsplit(None, 1)
            urls[name.strip()] = url
        elif line.startswith("watch the mesh: shardmesh "):
            return urls, line.removeprefix("watch the mesh: shardmesh ").split()
    raise AssertionError(f"no `shardmesh top` line after the metrics lines {urls}")


def test_sigterm_of_up_leaves_no_process(model: Path, tmp_path: Path) -> None:
    u = Up(model, 2, 1, tmp_path, "--metrics")
    try:
        # --metrics: every service's endpoint is printed, and serves; the suggested `top` finds them all
        urls, top = printed_metrics(u)
        # Which worker holds which stage is whichever registered first: read the id off each line.
        workers = {name: name.split()[0] for name in urls if name.startswith("worker-")}
        assert sorted(urls) == ["coordinator", "gateway", *sorted(workers)]
        assert sorted(re.sub(r"^worker-\d+ ", "", name) for name in workers) == [
            "(stage 0, tp rank 0)", "(stage 1, tp rank 0)"]  # fmt: skip
        assert sorted(workers.values()) == ["worker-0", "worker-1"]
        for name, url in urls.items():
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
            assert "shardmesh_" in text, name
            if name in workers:
                assert f'worker_id="{workers[name]}"' in text, name
        gateway_metrics = urls["gateway"].removeprefix("http://").removesuffix("/metrics")
        assert top[:2] == ["top", "--coordinator"] and top[-2:] == ["--gateway-metrics", gateway_metrics]
        frame = subprocess.run([sys.executable, "-m", "shardmesh_cli", *top, "--once", "--interval", "0.3"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert frame.returncode == 0, frame.stderr
        assert f"GATEWAY {gateway_metrics}  ready" in frame.stdout and "unreachable" not in frame.stdout, frame.stdout

        children = psutil.Process(u.proc.pid).children(recursive=True)
        assert len(children) == 4  # coordinator, 2 workers, gateway
        t0 = time.monotonic()
        u.proc.send_signal(signal.SIGTERM)
        u.proc.wait(timeout=20)
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left behind: {alive}"
        assert time.monotonic() - t0 < 15
    finally:
        u.close()


def test_sigkill_of_up_still_leaves_no_process(model: Path, tmp_path: Path) -> None:
    """`up` gets no chance to clean up; the kernel's parent-death signal stops every child anyway."""
    u = Up(model, 2, 1, tmp_path)
    try:
        children = psutil.Process(u.proc.pid).children(recursive=True)
        assert len(children) == 4
        u.proc.kill()
        u.proc.wait(timeout=10)
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"orphaned: {alive}"
    finally:
        u.close()
