"""Measure what real stage workers hold: start a coordinator and pp × tp `shardmesh worker` processes,
run one full step, read each worker's peak and current resident set from /proc/PID/status.

`python -m bench.worker_memory` measures the fixed cost of a worker process (a 2-layer model
of 0.2 MB) and prints the constants `memory.py` stores; the memory-model test uses `measure_workers`
on a checkpoint big enough that weights dominate.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shardmesh.core.topology import ServingLimits
from shardmesh.planning.memory import RuntimeCosts


@dataclass(frozen=True)
class Measured:
    """One worker, after its shard loaded and one step of `max_batch_tokens` tokens ran."""

    rank: int
    stage: int
    tp_rank: int
    layers: tuple[int, int]
    peak: int  # VmHWM: the most resident memory the process ever had
    current: int  # VmRSS after the step


def proc_status(pid: int) -> dict[str, int]:
    """VmHWM and VmRSS of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def measure_workers(
    model_dir: Path, pp: int, tp: int, limits: ServingLimits, dtype: str = "float32", log_dir: Path | None = None,
    timeout: float = 120.0,
) -> list[Measured]:  # fmt: skip
    """Start the services, wait for a complete topology, run one step on every shard, measure, stop."""
    import grpc

    from shardmesh.core.topology import Topology
    from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2, worker_pb2_grpc
    from shardmesh.rpc import procs
    from shardmesh_cli.up import free_port, wait_serving

    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="shardmesh-calibrate-"))
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDMESH_LOG_LEVEL": "warning"}
    children, files = [], []

    def spawn(name: str, *args: str) -> None:
        f = (log_dir / f"{name}.log").open("ab")
        files.append(f)
        children.append((name, procs.spawn(["-m", "shardmesh_cli", *args], env=env, stdout=f, stderr=f)))

    try:
        spawn("coordinator", "coordinator", "--listen", address, "--model", str(model_dir), "--pp", str(pp),
              "--tp", str(tp), "--dtype", dtype, "--kv-slots", str(limits.kv_slots), "--max-context",
              str(limits.max_context), "--max-batch-tokens", str(limits.max_batch_tokens),
              "--heartbeat-interval", "0.3")  # fmt: skip
        wait_serving(address, children, 60, log_dir)
        for rank in range(pp * tp):
            spawn(f"w{rank}", "worker", "--coordinator", address, "--worker-id", f"w{rank}")
        pids = {name: p.pid for name, p in children}
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(address) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            while True:
                topo = Topology.from_pb(stub.GetTopology(coordinator_pb2.GetTopologyRequest(), timeout=5))
                if topo.serving:  # complete, and the coordinator's balance check is done with the workers
                    break
                dead = [(n, p.returncode) for n, p in children if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"workers not ready ({dead or 'timeout'}); logs in {log_dir}")
                time.sleep(0.2)
        n = min(limits.max_batch_tokens, limits.max_context)
        sampling = worker_pb2.TokenSampling(temperature=0.0, top_p=1.0)
        entry = worker_pb2.BatchEntry(request_id="m", slot=0, start_pos=0, num_tokens=n, token_ids=[1] * n,
                                      sampling=sampling)  # fmt: skip
        request = worker_pb2.StepRequest(step_id=1, topology_version=topo.version, entries=[entry])
        channels = [grpc.insecure_channel(sh.address) for _, sh in topo.shards()]
        try:
            futures = [worker_pb2_grpc.StageWorkerStub(c).Step.future(request, timeout=120) for c in channels]
            for fut in futures:
                fut.result()
        finally:
            for c in channels:
                c.close()
        out = []
        for stage, shard in topo.shards():
            status = proc_status(pids[shard.worker_id])
            out.append(Measured(shard.rank, stage.index, shard.tp_rank, (stage.layer_start, stage.layer_end),
                                status["VmHWM"], status["VmRSS"]))  # fmt: skip
        return out
    finally:
        procs.stop_all([p for _, p in reversed(children)])
        for f in files:
            f.close()


TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 64}  # fmt: skip


def measure_runtime(log_dir: Path | None = None) -> tuple[RuntimeCosts, list[str]]:
    """The fixed cost of a worker process here: two stages of a 0.2 MB model, peak RSS minus its tensors.

    Measure it where you plan: much of it is file-backed pages of torch's shared libraries, and how many
    of those a process maps depends on the page cache (on one machine: 258 MiB in a venv whose files had
    been read before, 322 MiB in a freshly installed one). Returns the costs and a line per stage.
    """
    from shardmesh.engine.synthetic import write_checkpoint
    from shardmesh.planning.memory import load_model, shard_memory

    limits = ServingLimits(2, 64, 8)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "tiny", TINY)
        model = load_model(model_dir)
        measured = measure_workers(model_dir, 2, 1, limits, log_dir=log_dir)
    lines, process = [], {}
    for m in measured:
        est = shard_memory(model, m.layers, 1, m.tp_rank, "float32", limits)
        tensors = est.total - est.runtime  # this model's tensors: well under 1 MiB
        process[m.stage] = m.peak - tensors
        lines.append(f"stage {m.stage}: peak {m.peak / 2**20:.1f} MiB, tensors {tensors / 2**20:.2f} MiB -> "
                     f"process {(m.peak - tensors) / 2**20:.1f} MiB")  # fmt: skip
    base = min(process.values())
    return RuntimeCosts("cpu", base, max(0, process[0] - base)), lines


def main() -> int:
    """Measure the fixed cost of a worker and print it as memory.py stores it."""
    costs, lines = measure_runtime()
    print("\n".join(lines))
    print(f"WORKER_RSS_BYTES ~ {costs.process / 2**20:.1f} MiB, "
          f"FIRST_STAGE_EXTRA_BYTES ~ {costs.first_stage / 2**20:.1f} MiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
