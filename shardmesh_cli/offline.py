"""`shardmesh generate` without services: P × T local processes, one shard each, one request.

The launcher hosts the rendezvous store (a `TCPStore` on 127.0.0.1), starts one process per global
rank, and collects the result from the last stage. Each rank builds its shard, forms its groups,
and runs the same decode loop in lock step: the first stage embeds the tokens, activations flow
stage to stage over torch.distributed point-to-point, the last stage samples, and the sampled token
is broadcast to every rank so all of them know the next input and when to stop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from shardmesh.core import device_map
from shardmesh.core.config import ModelConfig
from shardmesh.core.dtypes import Quantization
from shardmesh.core.layout import shard_specs
from shardmesh.core.step import SamplingParams, Segment, blocks_for
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.groups import STAGINGS, Backend, GroupCollective, form_groups
from shardmesh.engine.loader import build_shard, check_shards, parse_dtype
from shardmesh.engine.offload import check_budget, streamer_of
from shardmesh.engine.sampling import random_seed, sample
from shardmesh.engine.stage import StageEngine
from shardmesh.rpc import log, procs


@dataclass(frozen=True)
class OfflineRequest:
    input_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class OfflineResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "length" | "stop"


def generate_local(
    model_dir: Path,
    request: OfflineRequest,
    pp: int = 1,
    tp: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
    timeout_s: float = 600.0,
    quantization: str = "none",
    memory_budget: int | None = None,
    kv_block_size: int = 0,
    link_staging: str = "auto",
) -> OfflineResult:
    """Run `request` on a fresh P × T mesh of local processes and return what the last stage sampled. With
    `memory_budget` (bytes of weights per process) layers that do not fit stream in for each step (`offload`);
    with `kv_block_size` the KV cache is paged, blocks of that many tokens, as a paged mesh serves."""
    devices = device_map.rank_devices(device, pp, tp)
    cfg = ModelConfig.from_dir(model_dir)
    check_shards(model_dir, shard_specs(cfg.num_layers, pp, tp), cfg)  # fail here, not in a child
    if memory_budget is not None:
        specs = shard_specs(cfg.num_layers, pp, tp)
        # each rank on its own device (a CPU rank maps the checkpoint, a GPU rank streams from pinned memory); with
        # int8 on a CPU the int8 copy of the layers is written here, once, before the ranks map it
        check_budget(model_dir, cfg, specs, parse_dtype(dtype), memory_budget, devices,
                     Quantization(quantization))  # fmt: skip
    cfg.check_fits(len(request.input_ids), request.max_new_tokens)
    world = pp * tp
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="shardmesh-") as tmp:
        req_file, result_file = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req_file.write_text(json.dumps(asdict(request)))
        children, logs, log_files = [], [], []
        env = {**os.environ, "OMP_NUM_THREADS": str(procs.threads_per_process(world))}
        try:
            with procs.terminate_on_signals():
                for rank in range(world):
                    logs.append(Path(tmp) / f"rank{rank}.log")
                    args = [
                        "-m", "shardmesh_cli.offline", "--model", str(model_dir), "--pp", str(pp), "--tp", str(tp),
                        "--rank", str(rank), "--store-port", str(store.port), "--request", str(req_file),
                        "--result", str(result_file), "--dtype", dtype, "--device", devices[rank],
                        "--quantize", quantization, "--kv-block-size", str(kv_block_size),
                        "--link-staging", link_staging,
                    ]  # fmt: skip
                    if memory_budget is not None:
                        args += ["--memory-budget", str(memory_budget)]
                    log_files.append(logs[-1].open("wb"))
                    children.append(procs.spawn(args, env=env, stderr=log_files[-1]))
                _wait(children, logs, timeout_s)
        finally:
            procs.stop_all(children)
            for f in log_files:
                f.close()
        return OfflineResult(**json.loads(result_file.read_text()))


def _wait(children: list, logs: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(c.poll() is None for c in children):
        for rank, c in enumerate(children):
            if c.poll() not in (None, 0):
                raise RuntimeError(f"rank {rank} exited with code {c.returncode}:\n{procs.tail(logs[rank])}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation did not finish within {timeout_s:.0f} s")
        time.sleep(0.05)
    for rank, c in enumerate(children):
        if c.returncode != 0:
            raise RuntimeError(f"rank {rank} exited with code {c.returncode}:\n{procs.tail(logs[rank])}")


def _rank_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    for name in ("--model", "--request", "--result", "--dtype", "--device"):
        ap.add_argument(name, required=True)
    ap.add_argument("--quantize", default="none", choices=Quantization.names())
    ap.add_argument("--memory-budget", type=int, default=None)
    ap.add_argument("--kv-block-size", type=int, default=0)
    ap.add_argument("--link-staging", default="auto", choices=STAGINGS)
    for name in ("--pp", "--tp", "--rank", "--store-port"):
        ap.add_argument(name, type=int, required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    logger = log.configure("shardworker-offline", rank=a.rank)
    req = json.loads(Path(a.request).read_text())
    request = OfflineRequest(
        req["input_ids"], req["max_new_tokens"], SamplingParams(**req["sampling"]), tuple(req["stop_ids"])
    )
    device = torch.device(a.device)
    if device.type == "cuda":  # this rank's own GPU (the launcher gives each a cuda:N) before NCCL forms groups
        torch.cuda.set_device(device)
    cfg = ModelConfig.from_dir(a.model)
    spec = shard_specs(cfg.num_layers, a.pp, a.tp)[a.rank]
    stage = a.rank // a.tp
    timeout = timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", a.store_port, None, False, timeout=timeout)
    groups = form_groups(store, "offline", spec, stage, a.pp, device, a.link_staging, timeout)
    # One group over all ranks, used only to share each sampled token. Gloo over host tensors whatever the devices:
    # NCCL cannot span a GPU rank and a CPU rank, and the message is 16 bytes per token, far too small for a copy to
    # or from the GPU to matter next to the step that produced it.
    world_pg = Backend("gloo", timeout).group(store, "offline/world", a.rank, a.pp * a.tp)
    world = GroupCollective(world_pg, a.rank, a.pp * a.tp)
    logger.info("shard_loading", stage=stage, layers=[spec.layer_start, spec.layer_end], tp_rank=spec.tp_rank,
                device=str(device), **groups.describe_links())  # fmt: skip
    dtype = parse_dtype(a.dtype)
    max_len = len(request.input_ids) + request.max_new_tokens
    model = build_shard(a.model, spec, groups.tp, dtype=dtype, device=device, max_len=max_len,
                        progress=a.rank == 0, cfg=cfg, quantization=Quantization(a.quantize),
                        memory_budget=a.memory_budget)  # fmt: skip
    streamer = streamer_of(model)
    logger.info("shard_loaded", quantization=a.quantize, linear_kernels=model.linear_kernels,
                offload=streamer.plan.describe() if streamer is not None else None)  # fmt: skip
    # One sequence: a slot of max_len positions, or blocks 0, 1, ... covering them, its block table
    bs = a.kv_block_size
    blocks = tuple(range(blocks_for(max_len, bs))) if bs else ()
    cache = model.make_paged_cache(len(blocks), bs, dtype, device) if bs else model.make_cache(1, dtype, device)
    logger.info("kv_cache", layout="paged" if bs else "slots", block_size=bs, blocks=len(blocks), bytes=cache.nbytes,
                attention_kernel=cache.attention_kernel)  # fmt: skip
    engine = StageEngine(model, groups, cache, device)
    result = _decode(engine, request, world, sampler_rank=(a.pp - 1) * a.tp, rank=a.rank, device=device,
                     blocks=blocks, block_size=bs)  # fmt: skip
    links = [link for link in (groups.prev, groups.next) if link is not None]
    logger.info("links", staged_bytes=sum(link.staged_bytes for link in links), **groups.describe_links())
    if a.rank == (a.pp - 1) * a.tp:
        Path(a.result).write_text(json.dumps(asdict(result)))
    logger.info("done", tokens=len(result.token_ids))


def _decode(
    engine: StageEngine, req: OfflineRequest, world: GroupCollective, sampler_rank: int, rank: int,
    device: torch.device, blocks: tuple[int, ...] = (), block_size: int = 0,
) -> OfflineResult:  # fmt: skip
    sampling = (
        req.sampling
        if req.sampling.greedy or req.sampling.seed is not None
        else replace(req.sampling, seed=random_seed())
    )
    inputs, start = list(req.input_ids), 0
    token_ids: list[int] = []
    logprobs: list[float] = []
    finish = "length"
    opts = dist.BroadcastOptions()
    opts.rootRank = sampler_rank
    for _ in range(req.max_new_tokens):
        batch = BatchLayout.build([Segment(0, start, len(inputs), blocks)], device, block_size)
        logits = engine.step(batch, torch.tensor(inputs) if engine.is_first else None)
        msg = torch.zeros(2, dtype=torch.float64)  # on the host: `world` is a Gloo group (`_rank_main`)
        if rank == sampler_rank:
            assert logits is not None
            drawn = sample(logits, [sampling], [start + len(inputs)])
            msg = torch.tensor([drawn.token_ids[0], drawn.logprobs[0]], dtype=torch.float64)
        world.pg.broadcast([msg], opts).wait()
        token = int(msg[0].item())
        token_ids.append(token)
        logprobs.append(float(msg[1].item()))
        start += len(inputs)
        inputs = [token]
        if token in req.stop_ids:
            finish = "stop"
            break
    return OfflineResult(token_ids, logprobs, finish)


if __name__ == "__main__":
    procs.die_with_parent_if_asked()
    try:
        _rank_main(sys.argv[1:])
    except KeyboardInterrupt:
        sys.exit(130)
