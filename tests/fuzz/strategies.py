"""Hypothesis strategies for what a hostile or broken client can send: any protobuf message of a descriptor (every
field random, set or not, out of range, unknown enum values, NaN, huge, empty), and JSON bodies for the HTTP API
(random JSON, and requests with every known field set to a random value of any type)."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

MAX_DEPTH = 3
MAX_REPEATED = 6

# Text as clients send it, and as they should not: empty, control characters, any plane, long. Protobuf refuses
# lone surrogates on the client side, so they are not generated here (the HTTP fuzz sends them as JSON escapes).
TEXT = st.text(st.characters(codec="utf-8"), max_size=40) | st.text(st.characters(codec="utf-8"), min_size=200,
                                                                   max_size=3000)  # fmt: skip

_INTEGERS = {
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
}  # fmt: skip


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    """Small values (what a field usually holds) as often as the extremes and anything between."""
    return (
        st.integers(max(low, -3), min(high, 300)) | st.sampled_from(sorted({low, high, 0, 1})) | st.integers(low, high)
    )


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INTEGERS:
        return _integers(*_INTEGERS[t])
    if t == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32) | st.sampled_from([0.0, 1.0, -1.0, 0.5, 2.0, 100.0])
    if t == FieldDescriptor.TYPE_DOUBLE:
        return st.floats() | st.sampled_from([0.0, 1.0, -1.0])
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return TEXT
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: unknown numbers travel too
        return st.sampled_from([v.number for v in field.enum_type.values]) | st.integers(0, 2**31 - 1)
    raise TypeError(f"no strategy for {field.full_name} of type {t}")


def value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    return scalar(field)


@st.composite
def messages(draw: st.DrawFn, descriptor: Descriptor, depth: int = 0, **fixed: Any) -> Message:
    """A `descriptor` message with each field left out or set to anything its type allows; a oneof gets at most one
    member. `fixed`: fields set to these values instead (a strategy or a value)."""
    from google.protobuf import message_factory

    msg = message_factory.GetMessageClass(descriptor)()
    if depth > MAX_DEPTH:
        return msg
    oneofs = {o.name: draw(st.sampled_from([None, *[f.name for f in o.fields]])) for o in descriptor.oneofs}
    for field in descriptor.fields:
        if field.name in fixed:
            wanted = fixed[field.name]
            _set(msg, field, draw(wanted) if isinstance(wanted, st.SearchStrategy) else wanted)
            continue
        group = field.containing_oneof
        if group is not None and oneofs[group.name] != field.name:
            continue
        if group is None and not draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, val = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            _set(msg, field, draw(st.dictionaries(value(key, depth), value(val, depth), max_size=MAX_REPEATED)))
        elif field.is_repeated:
            _set(msg, field, draw(st.lists(value(field, depth), max_size=MAX_REPEATED)))
        else:
            _set(msg, field, draw(value(field, depth)))
    return msg


def _set(msg: Message, field: FieldDescriptor, v: Any) -> None:
    target = getattr(msg, field.name)
    if isinstance(v, dict):
        for k, item in v.items():
            if isinstance(item, Message):
                target[k].CopyFrom(item)
            else:
                target[k] = item
    elif isinstance(v, list):
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in v:
                target.add().CopyFrom(item)
        else:
            target.extend(v)
    elif isinstance(v, Message):
        target.CopyFrom(v)
    else:
        setattr(msg, field.name, v)


# -- JSON for the HTTP API ----------------------------------------------------------------------------------------

ODD = ["", "user", "assistant", "text", "\ud800", "-1"]  # a lone surrogate: JSON's \ud800 escape carries one
JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                | st.text(max_size=30) | st.sampled_from(ODD))  # fmt: skip
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10),
                                                                                             inner, max_size=4),
                    max_leaves=12)  # fmt: skip

SHARED_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                 "stream_options", "user", "return_tokens_as_token_ids", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "min_p", "ignore_eos", "stop_token_ids", "logit_bias"]  # fmt: skip
CHAT_FIELDS = ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "functions",
               "function_call", "response_format"]  # fmt: skip
COMPLETION_FIELDS = ["prompt", "logprobs", "echo", "best_of", "suffix"]

# Values that are nearly right: a wrong type, a bound crossed, an empty list, NaN spelled as JSON cannot.
NEAR = (JSON_SCALARS | st.integers(-2, 300) | st.floats(-3, 3) | st.lists(st.integers(-1, 300), max_size=5)
        | st.lists(st.text(max_size=5), max_size=20) | st.just({"include_usage": True})
        | st.just({"type": "json_object"}) | st.just([{"type": "image_url", "image_url": {"url": "x"}}]))  # fmt: skip
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "", "x" * 70])},
                                optional={"content": st.none() | st.text(max_size=50) | NEAR,
                                          "tool_calls": NEAR, "name": JSON})  # fmt: skip


def bodies(kind: str) -> st.SearchStrategy[Any]:
    """A body for `kind` ("chat" or "text"): random JSON, or its own fields with random (often almost right) values
    around a valid core (messages / prompt) that is itself sometimes broken."""
    names = SHARED_FIELDS + (CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
    core = ({"messages": st.lists(MESSAGE, min_size=1, max_size=4) | NEAR} if kind == "chat" else
            {"prompt": st.text(max_size=60) | st.lists(st.integers(-1, 200), max_size=8) | NEAR})  # fmt: skip
    fields = st.fixed_dictionaries(core, optional={n: NEAR | JSON for n in names if n not in core})
    return JSON | fields | fields.map(lambda d: {**d, "max_tokens": 4, "stream": True})
