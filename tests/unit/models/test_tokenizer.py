"""Tests for ``shardmesh.models.tokenizer``: it must tokenize and render chats exactly like transformers.

The reference is transformers' tokenizer built from the same GGUF (``gguf_file=``); ours runs on
the ``tokenizer.json`` that ``shardmesh model pull`` wrote (fixtures ``ours``, ``reference``: conftest.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from shardmesh.models.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "",
    " leading space",
    "trailing spaces   ",
    "  two leading spaces",
    "line one\nline two\n\n\nline five",
    "\ttabs\tand\r\nwindows newlines",
    "Digits: 0 12 345 6789 3.14159 1,000,000",
    "x =  123",
    "\n\n1. first item\n2. second item",
    "def f(x):\n    return x ** 2  # square\n",
    'console.log(`${a}+${b}`); // {"json": [1, 2]}',
    "Emoji: 😀👍🏽🇫🇷 👨‍👩‍👧",
    "CJK: 日本語のテキスト、中文文本，한국어 텍스트",
    "Accents: café naïve façade Ångström São Paulo Øresund",
    "Mixed scripts: Привет мир, مرحبا, שלום, नमस्ते",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "special mid-word<|im_end|>text<|endoftext|>more",
    "<repo_name>org/repo<file_sep>main.py",
    "I'm sure they'll say it's fine, won't they? We've seen 'quotes'.",
    "Zero-width\u200bjoiner\u00a0nbsp and combining e\u0301",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi! 😀"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Translate 'cat' to 日本語.\nThanks."},
    ],
]

STREAM_TEXTS = [
    "Emoji: 😀👍🏽🇫🇷 👨‍👩‍👧 done",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "mixed ascii 😀 and CJK 漢字 and accents é ñ ü",
]


# -- equality with transformers ------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours: Tokenizer, reference: Any, text: str) -> None:
    for add_special in (True, False):
        ids = ours.encode(text, add_special_tokens=add_special)
        assert ids == reference.encode(text, add_special_tokens=add_special)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_special_tokens_are_single_ids(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert ours.decode([1, 4093, 2]) == "user"
    assert ours.vocab_size == 49152
    assert ours.eos_token_ids == {2}
    assert ours.special_tokens == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
    }


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["single", "system", "multi-turn"])
def test_chat_template_matches_transformers(ours: Tokenizer, reference: Any, messages: list) -> None:
    for add_prompt in (True, False):
        text = ours.apply_chat_template(messages, add_generation_prompt=add_prompt)
        expected = reference.apply_chat_template(messages, add_generation_prompt=add_prompt, tokenize=False)
        assert text == expected
    expected_ids = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.encode_chat(messages) == expected_ids


def test_default_system_prompt_and_generation_prompt(ours: Tokenizer) -> None:
    text = ours.apply_chat_template(CONVERSATIONS[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_converted_dir_loads_in_transformers_identically(model_dir: Path, ours: Tokenizer, reference: Any) -> None:
    """Not needed at runtime, but keeps the directory a faithful HF model dir."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        assert auto.encode(text) == reference.encode(text)
    messages = CONVERSATIONS[2]
    assert auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        ours.apply_chat_template(messages)
    )


# -- streaming detokenization --------------------------------------------------------------------


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_detokenizer_reassembles_text(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text, add_special_tokens=False)
    detok = ours.detokenizer()
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == ours.decode(ids) == text
    assert detok.text == text
    # Some characters really are split across tokens, so the hold-back path was exercised.
    assert any(d == "" for d in deltas[:-1])
    assert any("\ufffd" in ours.decode([i]) for i in ids)


def test_incremental_detokenizer_emits_char_once_complete(ours: Tokenizer) -> None:
    ids = ours.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(ours)
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "😀"
    assert detok.flush() == ""


def test_incremental_detokenizer_flushes_dangling_bytes_and_skips_specials(ours: Tokenizer) -> None:
    partial = ours.encode("😀", add_special_tokens=False)[:1]
    detok = ours.detokenizer()
    assert detok.add(1) == ""  # <|im_start|> is special: skipped
    assert detok.add(ours.encode("Hi", add_special_tokens=False)[0]) == "Hi"
    assert detok.add(partial[0]) == ""
    assert detok.flush() == ours.decode(partial) == "\ufffd"
    assert detok.add(2) == ""
    keep = ours.detokenizer(skip_special_tokens=False)
    assert keep.add(2) == "<|im_end|>"


# -- loading edge cases --------------------------------------------------------------------------


def test_from_dir_without_tokenizer_returns_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    assert Tokenizer.from_dir(tmp_path) is None


def _copy_tokenizer_files(model_dir: Path, dest: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, dest / name)
    return dest


def test_malformed_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_malformed_tokenizer_config_names_the_file(model_dir: Path, tmp_path: Path) -> None:
    _copy_tokenizer_files(model_dir, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": 5}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(tmp_path)


def test_eos_ids_merge_all_sources(model_dir: Path, tmp_path: Path) -> None:
    _copy_tokenizer_files(model_dir, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer is not None and tokenizer.eos_token_ids == {0, 2, 3}
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ValueError, match=r"/config\.json"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_errors_are_value_errors(model_dir: Path, tmp_path: Path) -> None:
    _copy_tokenizer_files(model_dir, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer is not None
    with pytest.raises(ValueError, match="user first"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer is not None and tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.encode_chat([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_beside_the_config_is_read_as_transformers_reads_it(model_dir: Path,
                                                                                tmp_path: Path) -> None:  # fmt: skip
    """Newer Hugging Face repos keep the template in `chat_template.jinja`, beside tokenizer_config.json; transformers
    reads it and lets it win over the config's `chat_template`, and so do we."""
    from transformers import AutoTokenizer

    _copy_tokenizer_files(model_dir, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "config: {{ messages[0]['content'] }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}\n<{{ m['role'] }}> {{ m['content'] }}{{ eos_token }}\n{% endfor %}\n"
        "{% if add_generation_prompt %}<assistant> {% endif %}\n"
    )  # fmt: skip

    def both() -> tuple[str, str]:
        ours, reference = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
        assert ours is not None
        messages = CONVERSATIONS[1]
        return ours.apply_chat_template(messages), reference.apply_chat_template(messages, add_generation_prompt=True,
                                                                                 tokenize=False)  # fmt: skip

    ours, reference = both()
    assert ours == reference == "<system> You are terse.<|im_end|>\n<user> Name a color.<|im_end|>\n<assistant> "
    del config["chat_template"]  # the file alone
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert both() == (ours, reference)
    config["chat_template"] = "config: {{ messages[0]['content'] }}"  # no file: the config's
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink()
    assert both() == ("config: You are terse.",) * 2
