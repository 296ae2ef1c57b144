"""The deployment manifest: one YAML file that says what to serve, on what, with which limits and where.

Validated by the pydantic models below (unknown fields refused, bounds per field). Every problem is
reported as one line naming the field's path and what was expected, e.g.
``parallelism.tensor: must be 'auto' or an integer >= 1, got 0``, never as a traceback. The JSON Schema
of the file (for editors and CI) is `schema()`, committed as ``compose/manifest.schema.json``.

Tensor split dimensions: attention is split by **heads** (query heads, and kv heads or their
replicas: q/k/v column-parallel, o_proj row-parallel) and the MLP by the **intermediate** dimension
(gate/up column-parallel, down_proj row-parallel); these are the only ones `shardmesh.engine.tp` implements.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from shardmesh.core.dtypes import DType, Quantization
from shardmesh.core.units import parse_bytes

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "compose" / "manifest.schema.json"
SCHEMA_ID = "https://shardmesh.dev/schemas/manifest-v1.json"
_ADDRESS = r"^[A-Za-z0-9_.\-\[\]:]*:\d{1,5}$"
_NAME = r"^[A-Za-z0-9_.-]+$"
_URL = r"^(https?|grpc)://[^\s/]+(/\S*)?$"
_DEVICE = r"^(cpu|cuda(:\d+)?)$"
_PATTERNS = {
    _ADDRESS: "host:port",
    _NAME: "a name of letters, digits, '_', '.' and '-'",
    _URL: "a URL like http://collector:4317",
    _DEVICE: "cpu, cuda or cuda:N",
}


class ManifestError(ValueError):
    """A manifest that cannot be used; `errors` holds one line per problem (path: what was expected)."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source, self.errors = source, errors
        super().__init__("\n".join(f"{source}: {e}" for e in errors))


# --- field types ----------------------------------------------------------------------------------------------


def _degree(value: Any) -> Any:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise PydanticCustomError("degree", "must be 'auto' or an integer >= 1, got {value}", {"value": repr(value)})


Degree = Annotated[
    Literal["auto"] | int,
    BeforeValidator(_degree),
    WithJsonSchema({"anyOf": [{"const": "auto"}, {"type": "integer", "minimum": 1}]}),
]


def _size(value: Any) -> int:
    try:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError
        return parse_bytes(value)
    except ValueError:
        raise PydanticCustomError(
            "byte_size", "must be a size like 80GiB, 48GB or 512MiB, or a number of bytes, got {value}",
            {"value": repr(value)},
        ) from None  # fmt: skip


ByteSize = Annotated[
    int,
    BeforeValidator(_size),
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 0},
                              {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([KkMmGgTt][Ii]?[Bb]|[Bb])?\s*$"}],
                    "description": "bytes, or a size with a unit: KB/MB/GB/TB (powers of 1000), "
                                   "KiB/MiB/GiB/TiB (powers of 1024)"}),
]  # fmt: skip


def _one_of(allowed: str, what: str, explain: str) -> Any:
    def check(value: Any) -> Any:
        if value != allowed:
            raise PydanticCustomError(
                "split_dim", "{what} can only be split by '{allowed}' ({explain}); got {value}",
                {"what": what, "allowed": allowed, "explain": explain, "value": repr(value)},
            )  # fmt: skip
        return value

    return check


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# --- sections -------------------------------------------------------------------------------------------------


class ModelSection(_Section):
    """What to serve."""

    path: str = Field(min_length=1, description="a built-in model name (smollm2-135m-instruct), a model directory "
                                                "(config.json + safetensors; relative to the manifest's directory), "
                                                "or a Hugging Face id ORG/NAME[@REV] (read from the hub cache, "
                                                "fetched first when a network is there)")  # fmt: skip
    revision: str | None = Field(
        None, min_length=1, max_length=256, description="the revision of a Hugging Face id in path: a branch, tag "
                                                        "or commit (default main); the same as ORG/NAME@REV",
    )  # fmt: skip
    dtype: Literal[DType.names()] = Field(  # type: ignore[valid-type]  # the enum's names: one JSON Schema "enum"
        "float32", description="dtype weights and KV cache are held in (the checkpoint is converted while loading)"
    )
    quantization: Literal[Quantization.names()] = Field(  # type: ignore[valid-type]
        "none", description="int8: the decoder layers' products and the LM head held as int8 with a float16 scale "
                            "and minimum per 32 inputs of a row, made while loading from the float checkpoint; the "
                            "embedding and norms stay in dtype",
    )  # fmt: skip
    served_model_name: str | None = Field(
        None, min_length=1, max_length=256, description="the model id of the OpenAI-compatible HTTP API "
                                                        "(default: path, as written here)",
    )  # fmt: skip


_HEADS = "query and key/value heads; q/k/v column-parallel, o_proj row-parallel"
_INTERMEDIATE = "the intermediate dimension; gate/up column-parallel, down_proj row-parallel"


class TensorSplit(_Section):
    """Which dimension tensor parallelism splits. Only what `shardmesh.engine.tp` implements is accepted."""

    attention: Annotated[
        Literal["heads"],
        BeforeValidator(_one_of("heads", "attention", _HEADS)),
    ] = Field("heads", description="attention is split by heads")
    mlp: Annotated[
        Literal["intermediate"],
        BeforeValidator(_one_of("intermediate", "mlp", _INTERMEDIATE)),
    ] = Field("intermediate", description="the MLP is split along its intermediate dimension")
    shares: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list, max_length=4096,
        description="each tensor-parallel rank's share of the MLP columns and the vocabulary, e.g. [2, 1, 1] (rank 0 "
        "holds half; the heads stay even); empty: equal shares. Needs an integer `tensor`, one share per rank",
    )  # fmt: skip


class Parallelism(_Section):
    """Tensor degree (ranks per stage) and pipeline stages; 'auto' lets the planner choose from `nodes`."""

    tensor: Degree = Field("auto", description="tensor-parallel degree per stage, or 'auto'")
    pipeline: Degree = Field("auto", description="pipeline stages, or 'auto'")
    tensor_split: TensorSplit = Field(default_factory=TensorSplit)  # type: ignore[arg-type]


class DeviceGroup(_Section):
    """`count` identical devices of one node."""

    count: int = Field(1, ge=1, le=4096, description="how many such devices the node has")
    memory: ByteSize = Field(description="memory of one device (accelerator memory, or host memory for CPU)")
    speed: float = Field(1.0, gt=0, le=1e6, description="relative throughput; only ratios between devices matter")


class Node(_Section):
    """One machine. Tensor-parallel groups never span nodes."""

    name: str = Field(pattern=_NAME, max_length=64, description="node name, unique in the manifest")
    devices: list[DeviceGroup] = Field(min_length=1, description="the node's devices, in groups of equal ones")
    labels: dict[str, str] = Field(default_factory=dict, description="worker --label values for this node's workers")


class Placement(_Section):
    """How the planner places stages on nodes and devices."""

    balance: Literal["memory", "speed"] = Field(
        "memory", description="split layers in proportion to each stage's free memory, or to its speed"
    )
    node_order: list[str] = Field(default_factory=list, description="nodes in pipeline order (default: as listed)")
    reserve: ByteSize = Field(0, description="memory every device keeps free beyond the predicted peak")
    runtime_overhead: ByteSize | None = Field(
        None, description="fixed bytes of one worker process (default: the CPU measurement in "
                          "shardmesh/planning/memory.py; set the CUDA context size for GPUs)",
    )  # fmt: skip
    max_stage_ratio: float = Field(
        1.25, ge=1.0, le=100.0, description="balance check before serving: a stage whose decode pass takes more "
                                            "than this times the fastest stage's is reported",
    )  # fmt: skip
    rebalance: Literal["none", "by-speed"] = Field(
        "none", description="by-speed: when the check finds the stages out of balance, re-split the layers by "
                            "the measured speeds (the workers reload) and check again",
    )  # fmt: skip
    require_balance: bool = Field(
        False, description="true: the gateway does not serve while the stages are out of balance (default: it "
                           "serves and the imbalance is reported)",
    )  # fmt: skip


class Serving(_Section):
    """Limits every shard allocates for."""

    kv_slots: int = Field(8, ge=1, le=65536, description="KV-cache slots per shard: sequences in flight")
    max_context: int | None = Field(
        None, ge=1, le=10_000_000, description="tokens per sequence, prompt + completion (default: the model's)"
    )
    max_batch_tokens: int | None = Field(
        None, ge=1, le=10_000_000, description="tokens per step over the batch (default: max_context)"
    )
    max_queue: int = Field(256, ge=1, le=1_000_000, description="waiting requests before RESOURCE_EXHAUSTED")
    kv_block_size: int = Field(
        0, ge=0, le=65536, description="tokens per block of a paged KV cache, e.g. 16 (blocks handed out to sequences "
                                       "as they grow, a cached prompt prefix's shared); 0: a slot of max_context "
                                       "tokens per sequence",
    )  # fmt: skip
    kv_cache_memory: ByteSize | None = Field(
        None, description="with kv_block_size: bytes per shard for the paged KV cache and activation log; the blocks "
                          "it buys on the most loaded shard are every shard's, at least one max_context sequence "
                          "(default: what the slot cache would take, kv_slots × max_context tokens)",
    )  # fmt: skip


class Telemetry(_Section):
    """Where telemetry goes: every service gets `--otlp-endpoint` and `--metrics-port` from here (`up`,
    which runs all services on one host, serves metrics on a free port per service instead)."""

    otlp_endpoint: str | None = Field(None, pattern=_URL,
                                      description="OTLP collector, e.g. http://collector:4317")  # fmt: skip
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus metrics port of every service")


class CoordinatorService(_Section):
    listen: str = Field("127.0.0.1:0", pattern=_ADDRESS, description="host:port; port 0 picks a free one")
    store_port: int = Field(0, ge=0, le=65535, description="rendezvous TCPStore port; 0 picks a free one")


class GatewayService(_Section):
    listen: str = Field("127.0.0.1:0", pattern=_ADDRESS, description="host:port clients reach; 0 picks a free port")
    http_listen: str | None = Field(
        "127.0.0.1:0", pattern=_ADDRESS, description="host:port of the OpenAI-compatible HTTP API (/v1/...); 0 picks "
                                                     "a free port; null: no HTTP API",
    )  # fmt: skip


class WorkerService(_Section):
    device: str = Field("cpu", pattern=_DEVICE, description="cpu, cuda or cuda:N")
    memory_budget: ByteSize | None = Field(
        None, description="bytes of weights each worker holds in memory (CPU): the leading layers of its shard that "
                          "fit stay, the others stream from the checkpoint every step (default: the whole shard)",
    )  # fmt: skip


class Security(_Section):
    """Mutual TLS and tokens for every service (paths relative to the manifest's directory); each one null: off."""

    tls_dir: str | None = Field(
        None, min_length=1, description="mutual TLS on every gRPC connection (HTTPS on the HTTP API): a directory as "
                                        "`shardmesh certs init` writes it (ca.pem; coordinator, gateway and worker "
                                        ".pem and .key)",
    )  # fmt: skip
    join_token_file: str | None = Field(
        None, min_length=1, description="the join token workers and gateways present to the coordinator (and to the "
                                        "workers), one per line; the coordinator accepts every line",
    )  # fmt: skip
    api_key_file: str | None = Field(
        None, min_length=1, description="the API keys clients present to the gateway, one per line",
    )  # fmt: skip


class Services(_Section):
    """The address of each service, and how they authenticate each other and their clients."""

    coordinator: CoordinatorService = Field(default_factory=CoordinatorService)  # type: ignore[arg-type]
    gateway: GatewayService = Field(default_factory=GatewayService)  # type: ignore[arg-type]
    worker: WorkerService = Field(default_factory=WorkerService)  # type: ignore[arg-type]
    security: Security = Field(default_factory=Security)  # type: ignore[arg-type]


class Manifest(_Section):
    """A shardmesh deployment: model, parallelism, nodes, placement, serving limits, telemetry, services."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, title="shardmesh deployment manifest")

    version: Literal[1] = Field(1, description="manifest format version")
    model: ModelSection
    parallelism: Parallelism = Field(default_factory=Parallelism)  # type: ignore[arg-type]
    nodes: list[Node] = Field(default_factory=list, description="machines and their devices (needed for 'auto')")
    placement: Placement = Field(default_factory=Placement)  # type: ignore[arg-type]
    serving: Serving = Field(default_factory=Serving)  # type: ignore[arg-type]
    telemetry: Telemetry = Field(default_factory=Telemetry)  # type: ignore[arg-type]
    services: Services = Field(default_factory=Services)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _cross_checks(self) -> Manifest:
        problems = []
        names = [n.name for n in self.nodes]
        for i, name in enumerate(names):
            if name in names[:i]:
                problems.append(f"nodes[{i}].name: duplicate node name {name!r}")
        for i, name in enumerate(self.placement.node_order):
            if name not in names:
                known = ", ".join(dict.fromkeys(names)) or "-"
                problems.append(f"placement.node_order[{i}]: unknown node {name!r}; nodes: {known}")
        s = self.serving
        if s.max_context is not None and s.max_batch_tokens is not None and s.max_batch_tokens > 64 * s.max_context:
            problems.append("serving.max_batch_tokens: more than 64 × max_context is never useful; got "
                            f"{s.max_batch_tokens}")  # fmt: skip
        if s.kv_cache_memory is not None and not s.kv_block_size:
            problems.append("serving.kv_cache_memory: sizes a paged KV cache, set serving.kv_block_size too (the slot "
                            "cache is sized by kv_slots and max_context)")  # fmt: skip
        if problems:
            raise ValueError("\n".join(problems))
        return self


# --- reading ------------------------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _fields_at(loc: tuple[int | str, ...]) -> list[str] | None:
    """The field names allowed in the mapping at `loc`, by walking the models' annotations."""
    model: Any = Manifest
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        candidates = [ann, *args]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return list(model.model_fields)


_MESSAGES = {
    "missing": "is required",
    "int_type": "must be an integer, got {input!r}",
    "float_type": "must be a number, got {input!r}",
    "string_type": "must be a string, got {input!r}",
    "bool_type": "must be true or false, got {input!r}",
    "list_type": "must be a list, got {input!r}",
    "dict_type": "must be a mapping of key: value, got {input!r}",
    "model_type": "must be a mapping of key: value, got {input!r}",
    "model_attributes_type": "must be a mapping of key: value, got {input!r}",
    "greater_than_equal": "must be >= {ge}, got {input!r}",
    "greater_than": "must be > {gt}, got {input!r}",
    "less_than_equal": "must be <= {le}, got {input!r}",
    "less_than": "must be < {lt}, got {input!r}",
    "string_too_short": "must not be empty",
    "string_too_long": "must be at most {max_length} characters",
    "too_short": "must list at least {min_length} item(s)",
    "literal_error": "must be {expected}, got {input!r}",
    "string_pattern_mismatch": "must be {pattern}, got {input!r}",
}


def _message(err: dict[str, Any]) -> str:
    kind, ctx = err["type"], dict(err.get("ctx") or {})
    if kind == "extra_forbidden":
        allowed = _fields_at(tuple(err["loc"][:-1]))
        return "unknown field" + (f"; expected one of: {', '.join(allowed)}" if allowed else "")
    if kind == "value_error":  # our cross-checks: the message carries its own path
        return str(ctx.get("error", err["msg"])).removeprefix("Value error, ")
    template = _MESSAGES.get(kind)
    if template is None:
        return err["msg"][0].lower() + err["msg"][1:]
    pattern = ctx.get("pattern", "")
    if kind == "string_pattern_mismatch":
        ctx["pattern"] = _PATTERNS.get(pattern, f"text matching {pattern!r}")
    return template.format(input=err.get("input"), **ctx)


def format_errors(e: ValidationError) -> list[str]:
    """One line per problem: ``path: what was expected``."""
    lines = []
    for err in e.errors(include_url=False):
        msg = _message(err)
        if err["type"] == "value_error" and not err["loc"]:
            lines += msg.splitlines()  # cross-checks name their own paths
        else:
            lines.append(f"{_path(tuple(err['loc']))}: {msg}")
    return lines


def parse_manifest(data: Any, source: str = "manifest") -> Manifest:
    """Validate an already-parsed document; ManifestError with one line per problem."""
    if not isinstance(data, dict):
        raise ManifestError(source, [f"(top level): must be a mapping of key: value, got {type(data).__name__}"])
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        raise ManifestError(source, format_errors(e)) from None


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a YAML manifest; ManifestError (one line per problem) for anything wrong."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ManifestError(str(p), [f"cannot read: {e.strerror or e}"]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ManifestError(str(p), [f"not valid YAML: {where}{problem}"]) from None
    return parse_manifest(data, str(p))


def schema() -> dict[str, Any]:
    """The JSON Schema of the manifest (draft 2020-12), as committed in compose/manifest.schema.json."""
    out = Manifest.model_json_schema(mode="validation")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **out}


def schema_text() -> str:
    return json.dumps(schema(), indent=2, sort_keys=True) + "\n"


def address_port(address: str) -> int:
    """The port of a host:port address."""
    return int(re.split(r":", address)[-1])
