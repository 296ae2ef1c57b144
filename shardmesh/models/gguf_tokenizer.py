"""A ``tokenizers.Tokenizer`` rebuilt from a GGUF's ``tokenizer.ggml.*`` metadata, and its tokenizer_config.json.

The rebuild is meant to equal what transformers' GGUF loader builds from the same file (its backend JSON,
key for key), so the ``tokenizer.json`` we write tokenizes exactly like the reference the tests compare with.
Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is supported.
"""

from __future__ import annotations

from typing import Any

from shardmesh.models.gguf_metadata import required

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# `tokenizer.ggml.pre` values whose text splitting is the classic GPT-2 regex, i.e. what
# `tokenizers.pre_tokenizers.ByteLevel(use_regex=True)` does. (llama.cpp additionally isolates
# digits for "smollm", as does SmolLM2's original tokenizer.json; transformers' GGUF loader does
# not, and we match transformers. SmolLM2's vocabulary has no multi-character digit tokens, so the
# only visible difference is a whitespace run right before a digit: "\n\n1." gives [198, 198, 33]
# here and [1116, 33] with digit isolation.)
_GPT2_REGEX_PRE = frozenset({"gpt2", "gpt-2", "smollm", "starcoder", "refact"})

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX_PRE = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


def byte_to_unicode_map() -> dict[int, str]:
    """The byte -> printable character table byte-level BPE vocabularies are spelled in.

    Printable Latin-1 bytes stand for themselves; every other byte (controls, space, ...) is
    assigned, in byte order, a character from U+0100 upwards (so space becomes 'Ġ', U+0120).
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def _spell_vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id, re-spelling any token written in raw UTF-8 into the byte alphabet."""
    spelling = byte_to_unicode_map()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    return vocab


def _parse_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed BPE merge {merge!r} in GGUF")
        pairs.append((parts[0], parts[1]))
    return pairs


def _pre_tokenizer(pre: str | None, add_prefix_space: bool) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre is None or pre in _GPT2_REGEX_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in _SPLIT_REGEX_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )
    known = sorted(_GPT2_REGEX_PRE | set(_SPLIT_REGEX_PRE))
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(known)})")


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> Any:
    """Add BOS/EOS on ``add_special_tokens=True`` only when the GGUF asks for it (SmolLM2 does not)."""
    from tokenizers import processors

    def marker(flag: str, key: str) -> tuple[str, int] | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if not meta.get(f"tokenizer.ggml.{flag}", False) or token_id is None:
            return None
        return tokens[int(token_id)], int(token_id)

    bos = marker("add_bos_token", "bos_token_id")
    eos = marker("add_eos_token", "eos_token_id")

    def sequence(piece: str, type_id: int) -> list[str]:
        head = [f"{bos[0]}:{type_id}"] if bos else []
        tail = [f"{eos[0]}:{type_id}"] if eos else []
        return [*head, f"{piece}:{type_id}", *tail]

    specials = sorted({t for t in (bos, eos) if t is not None}, key=lambda t: t[1])
    return processors.TemplateProcessing(
        single=sequence("$A", 0), pair=sequence("$A", 0) + sequence("$B", 1), special_tokens=specials
    )


def _added_tokens(meta: dict[str, Any], tokens: list[str]) -> tuple[list[Any], list[Any]]:
    """(special, plain) added tokens: control tokens plus the named bos/eos/unk/pad ones are special,
    so ``<|im_start|>`` in text encodes to a single id and ``skip_special_tokens`` drops it;
    user-defined tokens are matched whole but are not special.

    A control token spelled outside the byte alphabet is a llama.cpp mislabel; its vocabulary entry
    was re-spelled, so adding the raw string would create a new id past the model's vocab.
    """
    from tokenizers import AddedToken

    alphabet = set(byte_to_unicode_map().values())
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    special_ids = {i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL}
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            special_ids.add(int(meta[f"tokenizer.ggml.{key}"]))
    special = [
        AddedToken(tokens[i], normalized=False, special=True) for i in sorted(special_ids) if set(tokens[i]) <= alphabet
    ]
    plain = [
        AddedToken(tokens[i], normalized=False, special=False)
        for i, t in enumerate(types)
        if t == TOKEN_TYPE_USER_DEFINED and i not in special_ids and set(tokens[i]) <= alphabet
    ]
    return special, plain


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to what transformers builds from the same GGUF."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {model!r}")
    tokens = list(required(meta, "tokenizer.ggml.tokens"))
    merges = _parse_merges(list(required(meta, "tokenizer.ggml.merges")))
    tok = Tokenizer(
        BPE(
            vocab=_spell_vocab(tokens),
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tok.pre_tokenizer = _pre_tokenizer(
        meta.get("tokenizer.ggml.pre"), bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, tokens)
    special, plain = _added_tokens(meta, tokens)
    tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
    return tok


def build_tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special token strings, BOS/EOS flags and the chat template."""
    tokens = required(meta, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            config[name] = tokens[int(meta[f"tokenizer.ggml.{key}"])]
    if "llama.context_length" in meta:
        config["model_max_length"] = int(meta["llama.context_length"])
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config
