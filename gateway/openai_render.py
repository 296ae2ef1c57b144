"""The OpenAI-compatible API's responses, built from the scheduler's events (`gateway/results.py`).

One `Answer` per request follows its tokens as they arrive and renders either the whole response (`body`) or,
when streaming, one chunk per token event (`chunk`), then the usage chunk. The text is the gateway's own
(`TokenEvent.text_delta`: stop strings cut, multi-byte characters held back until complete), exactly what a
gRPC client gets; the finish reason is the gateway's in OpenAI's words (`stop`: an end-of-sequence token, a stop
string or a stop token; `length`).

Logprobs are under the model's raw distribution (what the last stage returns: before penalties, temperature,
top-k, top-p and min-p), the alternatives too, in OpenAI's shapes: chat's `logprobs.content[i].top_logprobs` lists
the `top_logprobs` most likely tokens at position i (empty when it is 0); completions' `logprobs.top_logprobs[i]`
maps the `logprobs` most likely tokens' texts, and the sampled token's, to their logprobs (so up to logprobs + 1
entries; just the sampled token for `logprobs: 0`), as vLLM does. A token is shown as its text, or as
`token_id:N` with vLLM's `return_tokens_as_token_ids`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from gateway.openai_schema import ResponseOptions
from gateway.results import FinishReason, Summary, TokenEvent

Kind = Literal["chat", "text"]
MIN_LOGPROB = -9999.0  # JSON has no -inf; the floor vLLM uses too

_OBJECT = {"chat": ("chat.completion", "chat.completion.chunk"), "text": ("text_completion", "text_completion")}


def finish_reason(reason: FinishReason) -> str:
    """OpenAI's name; CANCELLED never gets here (a cancelled request ends as an error)."""
    return reason.openai


def usage(summary: Summary) -> dict[str, int]:
    return {"prompt_tokens": summary.prompt_tokens, "completion_tokens": summary.completion_tokens,
            "total_tokens": summary.prompt_tokens + summary.completion_tokens}  # fmt: skip


class Answer:
    """One request's answer as it arrives: `add` each token event, then `body()`; or render each as a `chunk`."""

    def __init__(self, kind: Kind, response_id: str, model: str, options: ResponseOptions,
                 tokenizer: Any | None) -> None:  # fmt: skip
        self.kind, self.id, self.model, self.options = kind, response_id, model, options
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[tuple[tuple[int, float], ...]] = []  # the alternatives at each token's position
        self._offsets: list[int] = []  # where each token's text starts in `text` (completions' text_offset)
        self.summary: Summary | None = None

    def add(self, event: TokenEvent) -> None:
        self._offsets.append(len(self.text))
        self.text += event.text_delta
        self.token_ids.append(event.token_id)
        self.logprobs.append(max(event.logprob, MIN_LOGPROB))
        self.top_logprobs.append(tuple((t, max(lp, MIN_LOGPROB)) for t, lp in event.top_logprobs))
        if event.summary is not None:
            self.summary = event.summary

    # -- logprobs ---------------------------------------------------------------------------------------------

    def _decoded(self, token_id: int) -> str | None:
        """The token's own text, special tokens included; None without a tokenizer."""
        if self._tokenizer is None:
            return None
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """A token as logprobs show it: its own text, or `token_id:N` (asked for, or without a tokenizer)."""
        decoded = self._decoded(token_id)
        return f"token_id:{token_id}" if self.options.tokens_as_ids or decoded is None else decoded

    def _chat_logprob(self, token_id: int, lp: float) -> dict[str, Any]:
        decoded = self._decoded(token_id)
        raw = list(decoded.encode("utf-8")) if decoded is not None else None
        return {"token": self.token_text(token_id), "logprob": lp, "bytes": raw}

    def _logprobs(self, start: int) -> dict[str, Any] | None:
        """The logprobs object for tokens [start:], or None when the client did not ask for them."""
        if not self.options.logprobs:
            return None
        ids, lps, tops = self.token_ids[start:], self.logprobs[start:], self.top_logprobs[start:]
        if self.kind == "chat":
            content = [{**self._chat_logprob(token_id, lp), "top_logprobs": [self._chat_logprob(*alt) for alt in top]}
                       for token_id, lp, top in zip(ids, lps, tops, strict=True)]  # fmt: skip
            return {"content": content}
        tokens = [self.token_text(t) for t in ids]
        top_logprobs = []
        for token, lp, top in zip(tokens, lps, tops, strict=True):
            alternatives: dict[str, float] = {}
            for alt, alt_lp in top:  # most likely first: of two tokens that read the same, the likelier is shown
                alternatives.setdefault(self.token_text(alt), alt_lp)
            alternatives.setdefault(token, lp)
            top_logprobs.append(alternatives)
        return {"tokens": tokens, "token_logprobs": lps, "text_offset": self._offsets[start:],
                "top_logprobs": top_logprobs}  # fmt: skip

    # -- whole responses ----------------------------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        """The non-streaming response, once the last token is in."""
        assert self.summary is not None, "body() before the last token"
        reason = finish_reason(self.summary.finish_reason)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text},
                      "logprobs": self._logprobs(0), "finish_reason": reason}  # fmt: skip
        else:
            choice = {"index": 0, "text": self.text, "logprobs": self._logprobs(0), "finish_reason": reason}
        return {"id": self.id, "object": _OBJECT[self.kind][0], "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(self.summary)}  # fmt: skip

    # -- streaming ----------------------------------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"id": self.id, "object": _OBJECT[self.kind][1], "created": self.created, "model": self.model,
               "choices": choices}  # fmt: skip
        if self.options.include_usage:
            out["usage"] = None  # OpenAI: every chunk but the last carries "usage": null
        return out

    def opening(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role, as OpenAI's do; completions have no opening chunk."""
        if self.kind != "chat":
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])  # fmt: skip

    def chunk(self, event: TokenEvent) -> dict[str, Any] | None:
        """`add` the event and render it as a chunk; None for a token that adds no text, when the client wants
        neither logprobs nor is this the last token (text held back is sent with a later token)."""
        self.add(event)
        reason = finish_reason(event.summary.finish_reason) if event.summary is not None else None
        if not event.text_delta and not self.options.logprobs and reason is None:
            return None
        logprobs = self._logprobs(len(self.token_ids) - 1)
        if self.kind == "chat":
            delta = {"content": event.text_delta} if event.text_delta or reason is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": event.text_delta, "logprobs": logprobs, "finish_reason": reason}
        return self._chunk([choice])

    def usage_chunk(self) -> dict[str, Any] | None:
        """With stream_options.include_usage: the last chunk, no choices, the token counts."""
        if not self.options.include_usage or self.summary is None:
            return None
        return {"id": self.id, "object": _OBJECT[self.kind][1], "created": self.created, "model": self.model,
                "choices": [], "usage": usage(self.summary)}  # fmt: skip
