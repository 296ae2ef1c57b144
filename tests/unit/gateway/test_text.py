"""Text deltas: partial UTF-8 and possible stop strings are held back; the deltas add up to the text."""

from __future__ import annotations

from gateway.text import CompletionText
from gateway.watcher import ModelFiles
from tests.unit.gateway.fakes import ids_of


def _deltas(files: ModelFiles, completion: str, stop: tuple[str, ...]) -> tuple[list[str], CompletionText]:
    out = CompletionText(files.tokenizer, stop)
    deltas = []
    for token in ids_of(files, completion):
        deltas.append(out.add(token))
        if out.stopped:
            break
    deltas.append(out.finish())
    return deltas, out


def test_text_deltas_hold_back_partial_utf8_and_possible_stop_strings(model_files: ModelFiles) -> None:
    deltas, out = _deltas(model_files, "héllo 👋", ())
    assert "".join(deltas) == out.text == "héllo 👋" and "\ufffd" not in "".join(deltas)
    assert deltas[1] == "" and deltas[2] == "é"  # the first byte of "é" alone is not text yet
    deltas, out = _deltas(model_files, "one END two", ("END",))
    assert out.stopped and out.text == "one " == "".join(deltas)
    assert deltas[4:6] == ["", ""]  # "E", "N" held back: they could be the start of "END"
    deltas, out = _deltas(model_files, "an ENd", ("END",))
    assert not out.stopped and "".join(deltas) == "an ENd"  # held back, then released
    deltas, out = _deltas(model_files, "ab<|x", ("b<", "<|x"))
    assert out.text == "a"  # the earliest stop string wins
