"""A plan as a table for people and as JSON for programs."""

from __future__ import annotations

from typing import Any

from shardmesh.core.topology import ServingLimits
from shardmesh.core.units import format_bytes
from shardmesh.planning.devices import describe_devices
from shardmesh.planning.planner import Infeasible, Plan

COLUMNS = ("rank", "stage", "node", "device", "layers", "tp rank", "weights", "KV cache", "other", "total",
           "memory", "headroom")  # fmt: skip


def _rows(plan: Plan) -> list[tuple[str, ...]]:
    rows = []
    for sh in plan.shards:
        m = sh.memory
        rows.append((str(sh.rank), str(sh.stage), sh.device.node, str(sh.device.index),
                     f"[{sh.layers[0]}, {sh.layers[1]})", f"{sh.tp_rank}/{plan.tp}", format_bytes(m.weights),
                     format_bytes(m.kv_cache), format_bytes(m.other), format_bytes(m.total),
                     format_bytes(sh.device.memory), format_bytes(sh.headroom)))  # fmt: skip
    return rows


def notes(plan: Plan) -> list[str]:
    """What a person should know before deploying this plan."""
    out = []
    if plan.unused:
        out.append(f"unused devices: {', '.join(d.name for d in plan.unused)} (left over from whole tensor groups of "
                   f"a node, or too small to hold a layer)")  # fmt: skip
    if not plan.even_split:
        out.append("the coordinator splits layers evenly today; `shardmesh up --manifest` deploys this plan only "
                   "when the even split fits too")  # fmt: skip
    if not plan.model.has_weights:
        out.append(f"planned from config.json alone (weights assumed stored as {plan.model.checkpoint_dtype})")
    if plan.options.quantization == "int8":
        out.append(f"int8: the layers' products and the LM head take 1 byte per weight + a 4-byte scale and minimum "
                   f"per 32 inputs of a row; the embedding and norms stay in {plan.options.dtype}; loading holds one "
                   f"product in {plan.options.dtype} while it is quantized, a chunk of rows at a time")  # fmt: skip
    rt = plan.options.runtime
    where = "host memory (RSS)" if rt.device == "cpu" else "device memory"
    out.append(f"planned for {rt.device} workers, in {where}; other = the worker process ({format_bytes(rt.process)}"
               + (f", +{format_bytes(rt.first_stage)} on stage 0" if rt.first_stage else "")
               + "), rope tables and step activations, or the loading transient when larger"
               + (" (on CPU every matrix is briefly held twice while build_shard re-lays it out)"
                  if rt.device == "cpu" else ""))  # fmt: skip
    return out


def _kv_line(lim: ServingLimits) -> str:
    """The KV cache in words: slots × context, or a paged cache's blocks and the tokens they hold per shard."""
    if not lim.kv_block_size:
        return f"{lim.kv_slots} KV slots × {lim.max_context} tokens"
    tokens = lim.kv_blocks * lim.kv_block_size
    return (f"paged KV cache: {lim.kv_blocks} blocks × {lim.kv_block_size} tokens = {tokens} tokens per shard "
            f"({tokens // lim.max_context} sequences of the whole {lim.max_context}-token context, {tokens // 512} of "
            f"512 tokens; at most {lim.kv_slots} in flight: --kv-slots)")  # fmt: skip


def render_table(plan: Plan) -> str:
    """The plan as an aligned text table with a header and notes."""
    cfg, o = plan.model.cfg, plan.options
    int8 = ", int8 weights" if o.quantization == "int8" else ""
    weights = sum(sh.memory.weights for sh in plan.shards)
    kv = sum(sh.memory.kv_cache for sh in plan.shards)
    lines = [
        f"model: {plan.model.name} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads / "
        f"{cfg.num_kv_heads} kv heads, vocab {cfg.vocab_size})",
        f"serving: {o.dtype}{int8}, {_kv_line(o.limits)}, {o.limits.max_batch_tokens} tokens per step",
        f"plan: tp={plan.tp} × pp={plan.pp} on {len(plan.shards)} of {len(plan.shards) + len(plan.unused)} devices "
        f"(balance: {o.balance}); weights {format_bytes(weights)}, KV cache {format_bytes(kv)} in all",
        "",
    ]  # fmt: skip
    rows = [COLUMNS, *_rows(plan)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    left = {"node", "layers"}
    for r in rows:
        cells = [c.ljust(widths[i]) if COLUMNS[i] in left else c.rjust(widths[i]) for i, c in enumerate(r)]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    lines += [f"note: {n}" for n in notes(plan)]
    return "\n".join(lines)


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """Everything in the table, in bytes, plus the inputs."""
    o = plan.options
    return {
        "model": {"name": plan.model.name, "path": str(plan.model.path), "num_layers": plan.model.cfg.num_layers,
                  "has_weights": plan.model.has_weights, "checkpoint_dtype": plan.model.checkpoint_dtype},
        "dtype": o.dtype, "quantization": o.quantization,
        "limits": {"kv_slots": o.limits.kv_slots, "max_context": o.limits.max_context,
                   "max_batch_tokens": o.limits.max_batch_tokens, "kv_block_size": o.limits.kv_block_size,
                   "kv_blocks": o.limits.kv_blocks},
        "runtime": {"process": o.runtime.process, "first_stage": o.runtime.first_stage},
        "balance": o.balance, "reserve": o.reserve,
        "tp": plan.tp, "pp": plan.pp,
        "layer_split": [list(r) for r in plan.layer_split],
        "even_split": plan.even_split,
        "shards": [
            {"rank": sh.rank, "stage": sh.stage, "tp_rank": sh.tp_rank, "node": sh.device.node,
             "device": sh.device.index, "layers": list(sh.layers), "device_memory": sh.device.memory,
             "weights": sh.memory.weights, "kv_cache": sh.memory.kv_cache, "activations": sh.memory.activations,
             "buffers": sh.memory.buffers, "load": sh.memory.load, "runtime": sh.memory.runtime,
             "other": sh.memory.other, "total": sh.memory.total, "headroom": sh.headroom}
            for sh in plan.shards
        ],
        "unused_devices": [d.name for d in plan.unused],
        "devices": describe_devices(tuple(sh.device for sh in plan.shards) + plan.unused),
        "notes": notes(plan),
    }  # fmt: skip


def _fitted_json(plan: Plan) -> dict[str, Any]:
    """A proposal's plan, in bytes: its layout and each device's peak beside its memory."""
    return {
        "tp": plan.tp, "pp": plan.pp, "dtype": plan.options.dtype, "quantization": plan.options.quantization,
        "devices": describe_devices(tuple(sh.device for sh in plan.shards) + plan.unused),
        "layer_split": [list(r) for r in plan.layer_split], "reserve": plan.options.reserve,
        "shards": [{"rank": sh.rank, "node": sh.device.node, "device": sh.device.index, "layers": list(sh.layers),
                    "weights": sh.memory.weights, "kv_cache": sh.memory.kv_cache, "other": sh.memory.other,
                    "total": sh.memory.total, "device_memory": sh.device.memory, "headroom": sh.headroom}
                   for sh in plan.shards],
    }  # fmt: skip


def infeasible_to_json(e: Infeasible) -> dict[str, Any]:
    """The error, the model's weights beside the devices' memory, and each option with the plan it gives."""
    t = e.totals
    out: dict[str, Any] = {"error": "infeasible", "summary": e.summary, "missing_bytes": e.missing,
                           "closest": e.closest}  # fmt: skip
    if t is not None:
        out["weights"] = {"parameters": t.parameters, "bytes": t.weights}
        out["devices"] = {"spec": t.devices, "budget_bytes": t.budget}
    out["options"] = [{"text": s.text, "changes": s.changes, "plan": _fitted_json(s.plan) if s.plan else None,
                       **({"offload": s.offload.to_json()} if s.offload else {})}
                      for s in e.suggestions]  # fmt: skip
    return out
