"""Tests for bench/run.py's options, its plan of meshes and the targets it derives from the rows (no mesh is
started: rows are made up here, so every ratio and verdict can be worked out by hand)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import ClassVar

import pytest

from bench import conditions, llamacpp, run


def _row(dtype: str, pp: int, tp: int, streams: int, ms: float, tok_s: float, pipeline: str = "full",
         threads: int = 2, deployed: bool = True, decode_steps: int | None = None) -> dict:  # fmt: skip
    row = {"dtype": dtype, "pp": pp, "tp": tp, "pipeline": pipeline, "threads": threads, "streams": streams,
           "ms_per_token": ms, "aggregate_tok_s": tok_s, "ttft_ms": 50.0, "deployed": deployed,
           "layers": [30]}  # fmt: skip
    return row if decode_steps is None else {**row, "decode_steps": decode_steps}


def _by_name(found: list[dict], dtype: str, start: str) -> dict:
    return next(t for t in found if t["dtype"] == dtype and t["name"].startswith(start))


def _llama(ms: float, kind: str = "F32") -> dict:
    return {"ms_per_token_median": ms, "decode_tok_s": 1e3 / ms, "ttft_ms": 40.0, "threads": 2, "llama_cpp": "0.3",
            "gguf_type": kind}  # fmt: skip


def test_defaults_and_quick() -> None:
    a = run.parse_args([])
    assert (a.layouts, a.streams, a.dtype_list) == (run.LAYOUTS, run.STREAMS, ["float32", "bfloat16"])
    q = run.parse_args(["--quick"])
    assert (q.layout_list, q.stream_list) == ([(1, 1), (2, 1), (1, 3)], [1, 16])
    # Explicit layouts and streams win over --quick's.
    q = run.parse_args(["--quick", "--layouts", "1x1", "--streams", "1"])
    assert (q.layout_list, q.stream_list) == ([(1, 1)], [1])


@pytest.mark.parametrize(("argv", "message"), [
    (["--dtypes", "float32,int8"], "--dtypes: each must be one of float32, bfloat16, float16; got 'float32,int8'"),
    (["--layouts", "2"], "--layouts: each must be PPxTP, e.g. 2x1, got '2'"),
    (["--streams", "1,0"], "--streams: each must be a positive whole number, got '0'"),
    (["--pairs", "0"], "--pairs: must be a positive whole number, got '0'"),
    (["--pairs", "5"], "--pairs: must be even (A B B A ...), got 5"),
])  # fmt: skip
def test_wrong_options_name_the_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        run.parse_args(argv)
    assert message in capsys.readouterr().err


def test_plan_runs_every_layout_in_the_dtype_and_the_boundary_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run, "cores", lambda: 2)
    runs = run.plan_runs([(1, 1), (2, 1)], [1, 16], "bfloat16")
    assert {r["dtype"] for r in runs} == {"bfloat16"}
    got = [(r["pp"], r["tp"], r["pipeline"], r["threads"], r["streams"], r["deployed"], r.get("decode_steps"))
           for r in runs]  # fmt: skip
    # pp=2 twice (turns: all cores per stage, one step in flight, several decode steps per call as pp=1; full: one
    # core each, two steps in flight, one decode step per call); pp=1 again for what pp=1 as deployed does not
    # match: one thread, one call per token, one stream only.
    steps = run.DECODE_STEPS
    assert got == [(1, 1, "full", 2, [1, 16], True, steps), (2, 1, "turns", 2, [1, 16], True, steps),
                   (2, 1, "full", 1, [1, 16], True, 1), (1, 1, "full", 1, [1], False, 1)]  # fmt: skip


def test_targets_from_rows() -> None:
    rows = [
        _row("float32", 1, 1, 1, ms=20.0, tok_s=50.0, decode_steps=8),
        _row("float32", 1, 1, 16, ms=40.0, tok_s=400.0, decode_steps=8),
        _row("float32", 1, 1, 1, ms=24.0, tok_s=41.0, threads=1, deployed=False, decode_steps=1),
        _row("float32", 2, 1, 1, ms=24.3, tok_s=40.0, pipeline="full", threads=1, decode_steps=1),
        _row("float32", 2, 1, 16, ms=50.0, tok_s=380.0, pipeline="full", threads=1, decode_steps=1),
        _row("float32", 2, 1, 1, ms=21.0, tok_s=47.0, pipeline="turns", decode_steps=8),
        _row("float32", 1, 3, 1, ms=32.0, tok_s=31.0),
        _row("bfloat16", 1, 1, 1, ms=10.0, tok_s=100.0),
    ]
    bases = {"float32": {"llama_cpp": _llama(22.0)}, "bfloat16": {"llama_cpp": _llama(9.0, "BF16")}}
    found = run.targets(bases, rows, ["avx512f", "avx512_bf16"])
    vs = _by_name(found, "float32", "pp=1 one stream vs llama.cpp")
    assert (vs["value"], vs["met"]) == (pytest.approx(1.1), True)  # 22 / 20: faster than llama.cpp
    vs = _by_name(found, "bfloat16", "pp=1 one stream vs llama.cpp")
    assert (vs["value"], vs["met"]) == (pytest.approx(0.9), False)
    assert "BF16" in vs["detail"]
    tp = _by_name(found, "float32", "tp=3 vs pp=1")
    assert (tp["value"], tp["met"]) == (pytest.approx(1.6), False)  # 32 / 20 > 1.5
    boundary = _by_name(found, "float32", "stage boundary, `--pipeline full`")
    assert (boundary["value"], boundary["met"]) == (pytest.approx(0.3), True)  # 24.3 - 24.0 on 1 thread
    assert "+4.30 ms against pp=1 as deployed" in boundary["detail"]
    boundary = _by_name(found, "float32", "stage boundary, `--pipeline turns`")  # against pp=1 on 2 threads, 8 steps
    assert (boundary["value"], boundary["met"]) == (pytest.approx(1.0), False)
    assert boundary["detail"].startswith("each stage on 2 thread(s), 8 decode step(s) per call")
    pipe = _by_name(found, "float32", "pp=2 `--pipeline full` ÷ pp=1")
    assert (pipe["value"], pipe["met"]) == (pytest.approx(0.95), True)
    scale = _by_name(found, "float32", "16 streams ÷ one stream, pp=1")
    assert (scale["value"], scale["met"]) == (pytest.approx(8.0), True)
    scale = _by_name(found, "float32", "16 streams ÷ one stream, pp=2 `full`")
    assert (scale["value"], scale["met"]) == (pytest.approx(9.5), True)
    scale = _by_name(found, "bfloat16", "16 streams ÷ one stream, pp=1")
    assert scale["value"] is None and scale["note"] == "needs --streams 1,16"
    # bfloat16 measured pp=1 only: every other line says what it needs rather than a number.
    assert _by_name(found, "bfloat16", "tp=3")["note"] == "needs --layouts 1x1,1x3 and --streams 1"
    assert _by_name(found, "bfloat16", "stage boundary")["met"] is None


@pytest.mark.parametrize(
    ("cores", "goal", "met"), [(None, 1.5, True), (2, 1.5, True), (3, 1.1, False), (16, 1.1, False)]
)
def test_tp_target_is_tighter_with_a_core_per_rank(cores: int | None, goal: float, met: bool) -> None:
    rows = [_row("float32", 1, 1, 1, ms=20.0, tok_s=50.0), _row("float32", 1, 3, 1, ms=24.0, tok_s=41.0)]
    tp = _by_name(run.targets({"float32": {}}, rows, [], cores), "float32", "tp=3 vs pp=1")
    assert (tp["value"], tp["goal"], tp["met"], tp["target"]) == (pytest.approx(1.2), goal, met, f"<= {goal:g}×")
    by_rounds = _by_name(run.round_targets({"float32": {}}, [{**r, "round": 1} for r in rows], [], cores),
                         "float32", "tp=3 vs pp=1")  # fmt: skip
    assert by_rounds["goal"] == goal


def test_bfloat16_target_needs_native_bf16() -> None:
    rows = [_row("bfloat16", 1, 1, 1, ms=10.0, tok_s=100.0)]
    found = run.targets({"bfloat16": {"llama_cpp": _llama(8.0, "BF16")}}, rows, ["avx2", "avx512f"])
    vs = _by_name(found, "bfloat16", "pp=1 one stream vs llama.cpp")
    assert vs["value"] == pytest.approx(0.8) and vs["met"] is None and vs["target"] is None
    assert vs["note"] == "no target: this CPU lacks avx512_bf16 and amx_bf16"


def test_skipped_llama_and_failed_rows_are_reported(tmp_path: Path) -> None:
    rows = [_row("float32", 1, 1, 1, ms=20.0, tok_s=50.0),
            {"dtype": "bfloat16", "pp": 1, "tp": 1, "pipeline": "full", "threads": 2, "deployed": True,
             "failed": "RuntimeError: shardmesh up failed; logs in /tmp/x"}]  # fmt: skip
    bases = {
        "float32": {"decode_tok_s": 40.0, "ms_per_token": 25.0, "ttft_ms": 60.0, "llama_cpp": {"skipped": "no llama"}},
        "bfloat16": {"decode_tok_s": 80.0, "ms_per_token": 12.5, "ttft_ms": 60.0, "llama_cpp": _llama(9.0, "BF16")},
    }
    info = {"cpu": "AMD EPYC", "cpu_id": "family 25", "cpu_flags": ["avx512_bf16"], "cores": 2, "torch": "2",
            "date": "2026-01-01T00:00:00+00:00", "host": "h"}  # fmt: skip
    a = argparse.Namespace(model="m", new_tokens=8, rebalance="none", layouts="1x1", streams="1",
                           dtypes="float32,bfloat16", quick=False, rounds=1)  # fmt: skip
    md = run.markdown(info, bases, rows, run.targets(bases, rows, info["cpu_flags"]), a)
    assert "CPU flags that pick kernels: avx512_bf16." in md
    assert "llama.cpp, float32: not measured (no llama)." in md
    assert "float32: pp=1 one stream vs llama.cpp, same dtype" in md and "not measured (llama.cpp not measured" in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len({line.count("|") for line in table}) == 1  # every row has the header's columns
    assert "| 1.25 |" in table[1]  # 50 tok/s ÷ transformers' 40, same dtype
    assert "failed: RuntimeError: shardmesh up failed" in table[2]
    # bfloat16's only row failed, so its pp=1 line is not measured, not a division by a missing row.
    assert _by_name(run.targets(bases, rows, []), "bfloat16", "pp=1 one stream")["value"] is None


def test_llamacpp_baseline_falls_back_to_f16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp, "available", lambda: None)
    monkeypatch.setattr(llamacpp, "gguf_for", lambda kind, model: Path(f"/x/{kind}.gguf"))
    seen = []

    def measure(path: Path, ids: list[int], n: int, threads: int) -> dict:
        seen.append(path.name)
        if path.name == "bfloat16.gguf":
            raise ValueError("Failed to load model from file: /x/bfloat16.gguf\nmore")
        return {"ms_per_token_median": 9.0, "token_ids": [1, 2]}

    monkeypatch.setattr(llamacpp, "measure", measure)
    out = run.baseline_llamacpp("m", [1], 8, 2, "bfloat16")
    assert seen == ["bfloat16.gguf", "float16.gguf"]
    assert out == {"ms_per_token_median": 9.0, "gguf_type": "F16",
                   "fallback": "BF16: ValueError: Failed to load model from file: /x/bfloat16.gguf"}  # fmt: skip
    seen.clear()
    assert run.baseline_llamacpp("m", [1], 8, 2, "float32")["gguf_type"] == "F32"
    assert seen == ["float32.gguf"]


def test_machine_records_cpu_model_and_kernel_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardmesh.engine import cpu_features

    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512_bf16", "avx2", "sse2", "amx_int8"}))
    info = conditions.machine()
    assert info["cpu_flags"] == ["avx2", "avx512_bf16", "amx_int8"]  # only those that pick kernels, in order
    assert info["cpu"]


def test_rounds_option() -> None:
    assert run.parse_args([]).rounds == 1
    assert run.parse_args(["--quick", "--rounds", "3"]).rounds == 3
    assert (run.parse_args([]).pairs, run.parse_args(["--pairs", "4"]).pairs) == (run.PAIRED_REQUESTS, 4)


def test_rounds_must_be_positive(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        run.parse_args(["--rounds", "0"])
    assert "--rounds: must be a positive whole number, got '0'" in capsys.readouterr().err


def test_rounds_are_alternated_and_llamacpp_stays_beside_pp1(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Round 1 runs llama.cpp then the planned meshes; round 2 the same in reverse, so pp=1 (planned first) is
    beside llama.cpp in both; each mesh row carries its round."""
    monkeypatch.setattr(run, "cores", lambda: 2)
    order: list[str] = []

    def meshes(model_dir: Path, group: list[dict], ids: list[int], a: argparse.Namespace, flip: bool,
               probe: run.Probe | None = None) -> list[dict]:  # fmt: skip
        order.append("+".join(f"{r['round']}:{r['pp']}x{r['tp']}:{r['pipeline']}:{r['threads']}" for r in group)
                     + (" flipped" if flip else ""))  # fmt: skip
        return [_row(r["dtype"], r["pp"], r["tp"], 1, ms=10.0 * r["round"], tok_s=1.0, pipeline=r["pipeline"],
                     threads=r["threads"], deployed=r["deployed"], decode_steps=r["decode_steps"])
                | {"round": r["round"]} for r in group]  # fmt: skip

    def llama(model: str, ids: list[int], n: int, threads: int, dtype: str) -> dict:
        order.append(f"llama:{dtype}")
        return _llama(11.0 * sum(x.startswith("llama") for x in order))  # 11 ms in round 1, 22 in round 2

    saved = {}
    monkeypatch.setattr(run, "run_meshes", meshes)
    monkeypatch.setattr(run, "baseline_llamacpp", llama)
    monkeypatch.setattr(run, "baseline_transformers", lambda *args: {"decode_tok_s": 1.0, "ms_per_token": 1e3,
                                                                     "ttft_ms": 1.0})  # fmt: skip
    monkeypatch.setattr(run, "machine", lambda: {"cores": 2, "cpu_flags": []})
    monkeypatch.setattr(run, "report", lambda info, bases, rows, a, out: saved.update(bases=bases, rows=rows))
    monkeypatch.setattr("shardmesh.models.registry.resolve", lambda model: tmp_path)
    monkeypatch.setattr("shardmesh.models.tokenizer.Tokenizer.from_dir",
                        lambda d: type("T", (), {"encode_chat": lambda self, m: [1, 2]})())  # fmt: skip
    run.main(["--layouts", "1x1,2x1", "--streams", "1", "--dtypes", "float32", "--rounds", "2"])
    # Each pp=2 mesh is up at once with the pp=1 of its threads and decode steps per call (the boundary's pair).
    first = ["llama:float32", "1:1x1:full:2+1:2x1:turns:2", "1:1x1:full:1+1:2x1:full:1"]
    second = ["2:1x1:full:1+2:2x1:full:1 flipped", "2:1x1:full:2+2:2x1:turns:2 flipped", "llama:float32"]
    assert order == first + second
    base = saved["bases"]["float32"]
    assert [x["ms_per_token_median"] for x in base["llama_cpp_rounds"]] == [11.0, 22.0]
    assert base["llama_cpp"] is base["llama_cpp_rounds"][0]
    assert [r["round"] for r in saved["rows"]] == [1] * 4 + [2] * 4


def test_boundary_pairs_put_each_pp2_beside_its_like_for_like_pp1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run, "cores", lambda: 2)
    runs = run.plan_runs([(1, 1), (2, 1), (1, 3)], [1, 16], "float32")
    got = [[(r["pp"], r["tp"], r["pipeline"], r["threads"], r["decode_steps"]) for r in step]
           for step in run.boundary_pairs(runs)]  # fmt: skip
    steps = run.DECODE_STEPS
    assert got == [[(1, 1, "full", 2, steps), (2, 1, "turns", 2, steps)],  # pp=1 as deployed and `turns`
                   [(1, 1, "full", 1, 1), (2, 1, "full", 1, 1)],  # `full`, with pp=1 on one thread, a call per token
                   [(1, 3, "full", 1, steps)]]  # fmt: skip
    # Without one stream, or without its baseline, a pp=2 run stands alone.
    alone = run.boundary_pairs(run.plan_runs([(2, 1)], [1, 16], "float32"))
    assert [len(step) for step in alone] == [1, 1]
    assert [len(step) for step in run.boundary_pairs(run.plan_runs([(1, 1), (2, 1)], [16], "float32"))] == [1, 1, 1]


class _FakeMesh:
    """A mesh for `run_meshes` that starts no process: its address names it; what happened goes to `log`."""

    log: ClassVar[list[str]] = []

    def __init__(self, model_dir: Path, pp: int, tp: int, *args: object, **kwargs: object) -> None:
        self.address = f"pp{pp}"
        self.log.append(f"up {self.address}")

    def worker_peak_rss(self) -> list[int]:
        return [2**20]

    def layers(self) -> list[int]:
        return [30]

    def links(self) -> list[str]:
        return ["shm"]

    def priorities(self) -> list[str]:
        return ["realtime"]

    def bf16_rows(self) -> list[str]:
        return []

    def close(self) -> None:
        self.log.append(f"close {self.address}")


@pytest.mark.parametrize("flip", [False, True])
def test_a_boundary_pair_alternates_requests_so_drift_cancels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              flip: bool) -> None:  # fmt: skip
    """Both meshes are up before the first request and closed after the last; one stream alternates single requests
    A B B A ...; the host slowing down by 1 ms a request is in both sides' medians but in none of the pairs'
    differences, which are pp=2's own +0.4 ms."""
    log: ClassVar[list[str]] = []
    monkeypatch.setattr(_FakeMesh, "log", log)
    monkeypatch.setattr(run, "Mesh", _FakeMesh)
    own = {"pp1": 20.0, "pp2": 20.4}

    def streams(address: str, ids: list[int], new_tokens: int, n: int, repeats: int | None = None) -> dict:
        log.append(f"{address}x{n}" + (f" repeats={repeats}" if repeats else ""))
        ms = own[address] + sum(x.startswith("pp") for x in log)  # every request 1 ms slower than the last
        return {"streams": n, "tokens": 64 * n, "wall_s": ms * 64 * n / 1e3, "aggregate_tok_s": 1e3 / ms,
                "ttft_ms": 50.0, "ms_per_token": ms}  # fmt: skip

    monkeypatch.setattr(run, "run_streams", streams)
    a = argparse.Namespace(stream_list=[1, 16], rebalance="none", new_tokens=64, pairs=6)
    pair = run.boundary_pairs(run.plan_runs([(1, 1), (2, 1)], [1, 16], "float32"))[0]
    rows = run.run_meshes(tmp_path, pair, [1, 2], a, flip=flip)
    a_, b_ = ("pp2", "pp1") if flip else ("pp1", "pp2")
    one = [f"{x}x1 repeats=1" for x in [a_, b_, b_, a_] * 3]
    assert log == ["up pp1", "up pp2", *one, f"{a_}x16", f"{b_}x16", "close pp2", "close pp1"]
    by = {(r["pp"], r["streams"]): r for r in rows}
    assert by[(2, 1)]["boundary_each"] == [pytest.approx(0.4 + (1 if (i % 2 == 0) != flip else -1))
                                           for i in range(6)]  # fmt: skip
    # ABBA: A's request just before B's in even pairs, just after in odd ones; the drift of +-1 ms cancels in the
    # median only with an even count, and the reported boundary is pp=2's own +0.4 ms.
    found = run.boundary_targets("float32", rows)
    turns = _by_name(found, "float32", "stage boundary, `--pipeline turns`")
    assert turns["value"] == pytest.approx(0.4)
    assert "the median of 6 alternated requests' differences (-0.60 to +1.40)" in turns["detail"]
    assert by[(1, 16)]["links"] == ["shm"] and by[(2, 16)]["worker_peak_rss_mib"] == [1]


def test_round_targets_are_medians_of_each_rounds_own_ratio() -> None:
    """Each line is computed within a round against that round's llama.cpp and pp=1; the reported value is the
    median of the rounds' values, with their range; a line a round lacks is shown as missing, not as zero."""
    rows = []
    for number, (pp1, tp3) in enumerate([(10.0, 14.0), (16.0, 20.0), (11.0, 17.6)], 1):
        rows += [_row("float32", 1, 1, 1, ms=pp1, tok_s=1.0) | {"round": number},
                 _row("float32", 1, 3, 1, ms=tp3, tok_s=1.0) | {"round": number}]  # fmt: skip
    rows = [r for r in rows if not (r["round"] == 2 and r["tp"] == 3)]  # round 2's tp=3 mesh: no row
    bases = {"float32": {"llama_cpp": _llama(11.0), "llama_cpp_rounds": [_llama(11.0), _llama(14.0), _llama(12.1)]}}
    found = run.round_targets(bases, rows, [])
    vs = _by_name(found, "float32", "pp=1 one stream vs llama.cpp")
    # 11/10, 14/16, 12.1/11: the median 1.1, not a ratio of medians across rounds (12.1/11 = 1.1 too; see range).
    assert vs["rounds"] == [pytest.approx(1.1), pytest.approx(0.875), pytest.approx(1.1)]
    assert vs["value"] == pytest.approx(1.1) and vs["met"] is True
    assert vs["range"] == [pytest.approx(0.875), pytest.approx(1.1)]
    assert vs["detail"].startswith("median of 3 rounds (1.10, 0.88, 1.10); round 1: llama.cpp F32 11.00 ms/token")
    tp = _by_name(found, "float32", "tp=3 vs pp=1")
    assert tp["rounds"] == [pytest.approx(1.4), None, pytest.approx(1.6)]
    assert tp["value"] == pytest.approx(1.5) and tp["met"] is True  # median of 1.4 and 1.6, within 1.5
    assert "median of 2 rounds (1.40, –, 1.60)" in tp["detail"]
    assert "(range 1.40 to 1.60)" in run._target_line(tp)
    # One round: exactly the single-round lines.
    one = [r for r in rows if r["round"] == 1]
    assert run.round_targets(bases, one, []) == run.targets(bases, one, [])


def test_markdown_of_rounds_has_a_round_column() -> None:
    rows = [_row("float32", 1, 1, 1, ms=20.0, tok_s=50.0) | {"round": n} for n in (1, 2)]
    bases = {"float32": {"decode_tok_s": 40.0, "ms_per_token": 25.0, "ttft_ms": 60.0, "llama_cpp": _llama(22.0),
                         "llama_cpp_rounds": [_llama(22.0), _llama(18.0)]}}  # fmt: skip
    info = {"cpu": "AMD EPYC", "cpu_id": "family 25", "cpu_flags": [], "cores": 2, "torch": "2",
            "date": "2026-01-01T00:00:00+00:00", "host": "h"}  # fmt: skip
    a = argparse.Namespace(model="m", new_tokens=8, rebalance="none", layouts="1x1", streams="1", dtypes="float32",
                           quick=False, rounds=2)  # fmt: skip
    md = run.markdown(info, bases, rows, run.round_targets(bases, rows, []), a)
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| round | dtype |") and len({line.count("|") for line in table}) == 1
    assert [line.split("|")[1].strip() for line in table[1:]] == ["1", "2"]
    assert "llama.cpp float32 ms/token in rounds 1-2: 22.00, 18.00." in md
    assert "**1.00×** (range 0.90 to 1.10) (target >= 1×: **met**" in md
    assert "up at once" not in md  # no pair among these rows
    pairs = [0.1 * i for i in range(8)]
    paired = [*rows, _row("float32", 2, 1, 1, ms=20.5, tok_s=48.0, pipeline="turns") | {"boundary_each": pairs}]
    md = run.markdown(info, bases, paired, [], a)
    assert "alternated (8 each, A B B A ...)" in md
    # 8 pairs: a 95% interval of their median runs from the smallest to the largest (P(B = 0) = 1/256 each side).
    assert (
        "- float32, `--pipeline turns`: median **+0.35 ms** of 8 pairs, interval +0.00 to +0.70 ms: the interval "
        "holds 0.5 ms: this run cannot tell the boundary from the target."
    ) in md


def test_pooled_boundaries_take_every_round_and_say_what_the_interval_tells() -> None:
    def pp2(dtype: str, pipeline: str, each: list[float], number: int) -> dict:
        return _row(dtype, 2, 1, 1, ms=20.0, tok_s=50.0, pipeline=pipeline) | {"boundary_each": each, "round": number}

    low = [0.1, 0.2, 0.3, 0.2, 0.1, 0.3]
    rows = [pp2("float32", "turns", low, 1), pp2("float32", "turns", low, 2),  # 12 pairs, all under 0.5
            pp2("float32", "full", [0.9, 1.1, 0.8, 1.2, 1.0, 0.7], 1),        # 6 pairs, all over
            pp2("bfloat16", "turns", [0.1, 0.9, 0.2, 0.8, 0.4, 0.6], 1),      # 6 on both sides
            pp2("bfloat16", "full", [0.1, 0.2, 0.3], 1),                      # too few
            _row("float32", 1, 1, 1, ms=20.0, tok_s=50.0)]  # fmt: skip
    got = {(p["dtype"], p["pipeline"]): p for p in run.pooled_boundaries(rows)}
    assert got[("float32", "turns")]["pairs"] == 12 and got[("float32", "turns")]["median"] == pytest.approx(0.2)
    assert got[("float32", "turns")]["verdict"].endswith("**met**, beyond this run's noise")
    assert got[("float32", "full")]["verdict"].endswith("**not met**, beyond this run's noise")
    assert got[("float32", "full")]["interval"] == (0.7, 1.2)
    assert "cannot tell" in got[("bfloat16", "turns")]["verdict"]
    assert got[("bfloat16", "full")]["interval"] is None and "too few" in got[("bfloat16", "full")]["verdict"]
    assert "(too few for an interval)" in run._pooled_line(got[("bfloat16", "full")])


def test_the_memory_floor_is_set_beside_pp1_and_llamacpp_each_with_its_own_probe(monkeypatch: pytest.MonkeyPatch,
                                                                                tmp_path: Path) -> None:  # fmt: skip
    """The read probe's passes run after each of the deployed pp=1's one-stream requests (the meshes idle), on its
    threads, and land on its row; each one-stream step's floor is the weights' bytes at the median of the passes
    beside it, over its ms per token. 1 GB at 20 GB/s is 50 ms: pp=1 at 100 ms is 0.5x its floor, llama.cpp at 40 ms
    (its own probe at 25 GB/s: 40 ms) 1.0x. No target: the lines carry none."""
    log: ClassVar[list[str]] = []
    monkeypatch.setattr(_FakeMesh, "log", log)
    monkeypatch.setattr(run, "Mesh", _FakeMesh)

    def streams(address: str, ids: list[int], new_tokens: int, n: int, repeats: int | None = None) -> dict:
        log.append(f"{address}x{n}")
        return {"streams": n, "tokens": 64 * n, "wall_s": 6.4 * n, "aggregate_tok_s": 10.0, "ttft_ms": 50.0,
                "ms_per_token": 100.0}  # fmt: skip

    def probe(threads: int, passes: int) -> list[float]:
        log.append(f"probe threads={threads} passes={passes}")
        return [10.0, 20.0, 30.0][:passes]

    monkeypatch.setattr(run, "run_streams", streams)
    a = argparse.Namespace(stream_list=[1], rebalance="none", new_tokens=64, pairs=2)
    pairs = run.boundary_pairs(run.plan_runs([(1, 1), (2, 1)], [1], "float32"))
    rows = run.run_meshes(tmp_path, pairs[0], [1, 2], a, probe=probe)
    rows += run.run_meshes(tmp_path, pairs[1], [1, 2], a, probe=probe)  # its pp=1 is not deployed: not probed
    probed = f"probe threads={pairs[0][0]['threads']} passes={run.PROBE_PASSES}"
    assert log[:8] == ["up pp1", "up pp2", "pp1x1", probed, "pp2x1", "pp2x1", "pp1x1", probed]
    assert log.count(probed) == 2 and sum(x.startswith("probe") for x in log) == 2
    pp1 = next(r for r in rows if r["pp"] == 1 and r["deployed"])
    assert pp1["probe_gbps"] == [10.0, 20.0, 30.0] * 2
    assert not any(r.get("probe_gbps") for r in rows if r is not pp1)
    base = {"weight_bytes": 10**9, "llama_cpp": _llama(40.0), "probe_llama": [25.0, 24.0, 26.0]}
    found = run.floor_targets("float32", base, rows)
    ours, llama = found
    assert ours["value"] == pytest.approx(0.5) and llama["value"] == pytest.approx(1.0)
    assert ours["met"] is None and ours["target"] is None and "floor 50.00 ms: 1000 MB at 20.0 GB/s" in ours["detail"]
    assert "(median of 6 passes), against 100.00 ms/token" in ours["detail"]
    line = run._target_line(ours)
    assert "**0.50×**" in line and "no target" in line and "not met" not in line
    # Without the probe (it would not build, or no checkpoint to size) both lines say why, and nothing breaks.
    skipped = run.floor_targets("float32", {"probe_skipped": "RuntimeError: no compiler"}, rows)
    assert all(t["value"] is None and "not measured: RuntimeError: no compiler" in t["note"] for t in skipped)
    assert "Read probe, float32: not measured (RuntimeError: no compiler)" in run._probe_line(
        "float32", {"probe_skipped": "RuntimeError: no compiler"}, rows
    )
    assert "GB/s by round: beside llama.cpp 25.0; between pp=1's requests 20.0." in run._probe_line(
        "float32", {**base, "probe_llama_rounds": [[25.0]]}, rows
    )
