"""Runtime tokenizer for the mesh: encode/decode, chat templates and streaming detokenization.

Why not transformers' AutoTokenizer: transformers is a test-only dependency. Everything here runs
on the ``tokenizers`` library (for ``tokenizer.json``) plus jinja2 (for chat templates), and is
written to produce exactly what transformers produces for the same directory, so prompts built by
the gateway match what the model saw in training and what our tests compare against.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
_TEMPLATE_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, None when the file is absent, ValueError naming it when malformed."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, source: Path) -> str | None:
    """Special tokens in tokenizer_config.json are either a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{source}: special token must be a string or {{'content': ...}}, got {value!r}")


def _as_id_list(value: Any, source: Path, key: str) -> list[int]:
    """``eos_token_id`` may be an int, a list of ints, or absent."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{source}: {key} must be an int or a list of ints, got {value!r}")
    return list(values)


def _select_chat_template(value: Any, source: Path) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or a list of named templates (use 'default')."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        if isinstance(template, str):
            return template
    raise ValueError(f"{source}: chat_template must be a string or a list with a 'default' entry")


def _compile_chat_template(template: str) -> Any:
    """Compile with the same environment transformers uses, so templates render byte-identically.

    Sandboxed because templates are data shipped with a model, not trusted code.
    """
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # jinja's own tojson HTML-escapes; transformers overrides it with plain json.dumps.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc


class Tokenizer:
    """A model's tokenizer: ``tokenizer.json`` + the bits of ``tokenizer_config.json`` we need."""

    def __init__(
        self,
        backend: Any,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.chat_template: str | None = chat_template
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.eos_token_ids: set[int] = set(eos_token_ids)
        self._compiled_template: Any = None

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """Load from an HF-style directory; None when it has no ``tokenizer.json``.

        eos ids are the union of tokenizer_config's ``eos_token`` and the ``eos_token_id`` of
        generation_config.json and config.json, because chat models often stop on several tokens.
        """
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            return None
        backend = _load_backend(tokenizer_file)
        config_file = model_dir / "tokenizer_config.json"
        tok_config = _read_json(config_file) or {}
        special = {}
        for name in _TEMPLATE_SPECIAL_TOKENS:
            content = _token_content(tok_config.get(name), config_file)
            if content is not None:
                special[name] = content
        template = _select_chat_template(tok_config.get("chat_template"), config_file)
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        eos_ids = _collect_eos_ids(model_dir, backend, special.get("eos_token"))
        return cls(backend, chat_template=template, special_tokens=special, eos_token_ids=eos_ids)

    # -- basic encode / decode ----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added/special tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids for ``text``; special tokens written in the text (``<|im_start|>``) stay whole.

        ``add_special_tokens`` is keyword-only and required on purpose: whether BOS gets added is
        the classic source of silent prompt mismatches.

        Through the batch form (one text, no offsets): unlike ``encode`` it releases the interpreter lock
        while the Rust side works, so a long prompt does not stall every other thread of the process.
        """
        return list(self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)

    @functools.cached_property
    def max_bytes_per_token(self) -> int:
        """At most how many bytes of UTF-8 text one token stands for: a text longer than ``n ×`` this
        tokenizes to more than ``n`` tokens, which a caller can know without tokenizing it.

        A token stands for its vocabulary string. In a byte-level vocabulary (GPT-2's, SmolLM2's, Llama
        3's) each character of that string is one byte of text; in a SentencePiece one (Llama 2's,
        Mistral's) the string is the text itself, with '▁' (3 bytes) for a space and '<0xNN>' for one
        byte, so its UTF-8 length is an upper bound. An added token stands for its content. A normalizer
        runs before any of this: Prepend, and Replace by something no shorter, only lengthen the text;
        the Unicode normalizations and lowercasing shorten it at most 3× (three 3-byte Hangul jamo compose
        into one syllable, the 3-byte Kelvin sign lowercases to 'k'), so they multiply the bound by 3.
        Anything else (Strip, an added token that swallows the spaces beside it), which no tokenizer of
        the supported families uses, could shorten it further: the bound is then approximate.
        """
        spec = json.loads(self._backend.to_str())
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))  # the decoder, or one in its sequence
        vocab = self._backend.get_vocab(with_added_tokens=False)
        longest = max((len(t) if byte_level else len(t.encode("utf-8")) for t in vocab), default=1)
        added = self._backend.get_added_tokens_decoder().values()
        longest = max([longest, *(len(t.content.encode("utf-8")) for t in added)])
        return max(1, longest) * _normalizer_shrink(spec.get("normalizer"))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """Render ``messages`` as a prompt string, exactly as transformers' ``apply_chat_template``.

        Raises ValueError when the model has no template or the template rejects the conversation
        (``raise_exception``), so callers can turn it into a client error.
        """
        import jinja2

        if not self.chat_template:
            raise ValueError("this model has no chat template")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        # Like transformers: keys whose value is None are dropped (OpenAI clients send content=None).
        cleaned = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        try:
            return self._compiled_template.render(
                messages=cleaned,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids for a conversation; like transformers, the template supplies any BOS itself,
        so no special tokens are added on top."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    # -- streaming -----------------------------------------------------------------------------

    def detokenizer(self, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> int:
    """How many times shorter (in UTF-8 bytes) a normalizer can make a text, by `Tokenizer.max_bytes_per_token`'s
    reasoning: 1 for none, Prepend and a Replace that does not shorten; 3 for the rest; a Sequence multiplies."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        return math.prod(_normalizer_shrink(n) for n in normalizer.get("normalizers", []))
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern = normalizer.get("pattern", {}).get("String")
        if isinstance(pattern, str) and len(normalizer.get("content", "").encode()) >= len(pattern.encode()):
            return 1
    return 3


def _load_backend(path: Path) -> Any:
    from tokenizers import Tokenizer as BackendTokenizer

    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: malformed JSON ({exc})") from exc
    try:
        return BackendTokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises a bare Exception
        raise ValueError(f"{path}: not a valid tokenizers file ({exc})") from exc


def _collect_eos_ids(model_dir: Path, backend: Any, eos_token: str | None) -> set[int]:
    ids: set[int] = set()
    if eos_token is not None:
        token_id = backend.token_to_id(eos_token)
        if token_id is not None:
            ids.add(int(token_id))
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        data = _read_json(path) or {}
        ids.update(_as_id_list(data.get("eos_token_id"), path, "eos_token_id"))
    return ids


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas for streaming responses.

    Why not decode each token alone: byte-level BPE splits multi-byte UTF-8 characters (emoji, CJK)
    across tokens, and some decoders depend on neighbouring tokens. So we decode a small window
    ``ids[prefix:]`` and compare it with the already-emitted part ``ids[prefix:read]``; when the
    window's text ends in U+FFFD the last character is still incomplete and we wait for more
    tokens. The concatenation of all deltas plus ``flush()`` equals ``decode(all_ids)``.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self._skip_special)

    def _delta(self) -> str:
        emitted = self._decode(self._prefix, self._read)
        window = self._decode(self._prefix, len(self.token_ids))
        return window[len(emitted) :]

    def add(self, token_id: int) -> str:
        """Feed one token id; returns the newly completed text (possibly "")."""
        self.token_ids.append(int(token_id))
        delta = self._delta()
        if not delta or delta.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self.token_ids)
        self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (at end of stream a dangling partial character is emitted as
        U+FFFD, exactly as a full decode would render it)."""
        if self._read == len(self.token_ids):
            return ""
        delta = self._delta()
        self._prefix = self._read = len(self.token_ids)
        self._emitted.append(delta)
        return delta
