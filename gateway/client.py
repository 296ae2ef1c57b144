"""`shardmesh generate --gateway ADDR`: the offline command's interface, served by a running gateway.

The prompt is sent the way the offline mode would build it: a PROMPT becomes a single user chat
message when the model has a chat template (asked with GetModelInfo) and `--raw` is not given,
otherwise raw text; `--token-ids` are sent as they are. `--json` prints the same object as the
offline mode; without it the text is printed as it streams in. A gateway error is one line on
stderr, `error: <STATUS>: <message>`, and exit code 1.

A mesh with mutual TLS takes `--tls-cert/--tls-key/--tls-ca` (or $SHARDMESH_TLS_*); a gateway with API keys takes
the first line of `--api-key-file`, else $SHARDMESH_API_KEY.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

EXIT_ERROR = 1
# As the offline mode (and OpenAI) name them: an end-of-sequence token, a stop string or a stop token is "stop".
_FINISH_NAMES = {1: "length", 2: "stop", 3: "cancelled", 4: "stop", 5: "stop"}


def build_request(args: argparse.Namespace, token_ids: list[int] | None, has_chat_template: bool) -> Any:
    from shardmesh.proto.v1 import gateway_pb2

    params = gateway_pb2.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                        top_p=args.top_p, top_k=args.top_k, stop=args.stop or [])  # fmt: skip
    if args.seed is not None:
        params.seed = args.seed
    if token_ids is not None:
        return gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=token_ids), params=params)
    if has_chat_template and not args.raw:
        chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=args.prompt)])
        return gateway_pb2.GenerateRequest(chat=chat, params=params)
    return gateway_pb2.GenerateRequest(prompt=args.prompt, params=params)


def generate(args: argparse.Namespace, token_ids: list[int] | None, out: TextIO = sys.stdout) -> int:
    """Run one request against the gateway at `args.gateway`; returns the exit code."""
    import grpc

    from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc

    timeout = args.timeout
    with connect(args) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        try:
            has_template = False
            if token_ids is None and not args.raw:
                has_template = stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=timeout).has_chat_template
            request = build_request(args, token_ids, has_template)
            if args.json:
                r = stub.Generate(request, timeout=timeout)
                result = {"token_ids": list(r.token_ids), "logprobs": list(r.logprobs), "text": r.text,
                          "finish_reason": _FINISH_NAMES.get(r.finish_reason, "unspecified")}  # fmt: skip
                print(json.dumps(result), file=out)
                return 0
            return _stream(stub.GenerateStream(request, timeout=timeout), out)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return EXIT_ERROR


def connect(args: argparse.Namespace) -> Any:
    """A channel to `args.gateway` with the TLS files and the API key the arguments and the environment give."""
    from gateway.app import API_KEY_ENV
    from shardmesh.rpc import tls, tokens
    from shardmesh.rpc.flags import UsageError

    try:
        files = tls.from_args(args)
        value = getattr(args, "api_key", None) or tokens.env_value(API_KEY_ENV)
        key = tokens.presented(value, getattr(args, "api_key_file", None), "--api-key-file")
    except (tls.TlsError, tokens.TokenError) as e:
        raise UsageError(str(e)) from None
    return tls.channel(args.gateway, files, token=key)


def _stream(responses: Any, out: TextIO) -> int:
    """Print text deltas as they arrive; a model without a tokenizer gets its token ids instead."""
    ids: list[int] = []
    any_text = False
    for message in responses:
        ids.append(message.token_id)
        if message.text_delta:
            any_text = True
            out.write(message.text_delta)
            out.flush()
    if not any_text and ids:
        out.write(" ".join(map(str, ids)))
    out.write("\n")
    out.flush()
    return 0
