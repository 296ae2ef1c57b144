"""Models by Hugging Face id (`shardmesh.models.hub` through `registry.resolve`), with no network.

The hub cache is built by hand in tmp (`tests/hub_cache.py`, the layout `huggingface_hub` writes, which
`scan_cache_dir` is asked to recognise) and read with `HF_HUB_OFFLINE=1`. Downloading is checked against a fake
Hub on 127.0.0.1 that serves the few routes `snapshot_download` uses and records which files were fetched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from coordinator import app as coordinator_app
from shardmesh.core.config import ModelConfig
from shardmesh.models import hub
from shardmesh.models.registry import RevisionError, UnknownModelError, resolve
from shardmesh_cli import offline, up
from shardmesh_cli.main import build_parser, main
from tests.checkpoints import make_checkpoint
from tests.hub_cache import add_revision, commit_of, repo_folder

REPO = "tiny-org/tiny-llama"
MAIN, OLD = commit_of("main"), commit_of("v1")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two revisions of one tiny model (different weights, 2 and 4 layers), and a sharded one."""
    base = tmp_path_factory.mktemp("checkpoints")
    return {
        "main": make_checkpoint(base / "main", "llama-gqa-tied", num_layers=2, seed=1),
        "v1": make_checkpoint(base / "v1", "llama-gqa-tied", num_layers=4, seed=2),
        "sharded": make_checkpoint(base / "sharded", "llama-gqa-tied", num_layers=2, seed=3, max_shard_size="40KB"),
    }


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache under HF_HOME, offline; returns the cache directory (HF_HOME/hub)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


@pytest.fixture
def cached(hub_cache: Path, checkpoints: dict[str, Path]) -> dict[str, Path]:
    """REPO in the cache: `main` at MAIN, tag `v1` at OLD; returns the two snapshot directories."""
    return {
        "main": add_revision(hub_cache, REPO, checkpoints["main"], MAIN, refs=("main",)),
        "v1": add_revision(hub_cache, REPO, checkpoints["v1"], OLD, refs=("v1",)),
    }


def test_the_handmade_cache_is_what_huggingface_hub_writes(hub_cache: Path, cached: dict[str, Path]) -> None:
    from huggingface_hub import scan_cache_dir

    (repo,) = scan_cache_dir(hub_cache).repos
    assert repo.repo_id == REPO and {r.commit_hash for r in repo.revisions} == {MAIN, OLD}
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {MAIN: {"main"}, OLD: {"v1"}}


def test_an_id_resolves_to_its_cached_snapshot_offline(hub_cache: Path, cached: dict[str, Path]) -> None:
    path = resolve(REPO)
    assert path == cached["main"] == repo_folder(hub_cache, REPO) / "snapshots" / MAIN
    assert (path / "model.safetensors").is_symlink()  # the cache's own files, not a copy
    assert ModelConfig.from_dir(path).num_layers == 2
    assert hub.model_name(path) == REPO


def test_a_revision_is_a_branch_a_tag_or_a_commit(cached: dict[str, Path]) -> None:
    assert resolve(f"{REPO}@v1") == cached["v1"]
    assert resolve(REPO, revision="v1") == cached["v1"]
    assert resolve(f"{REPO}@{OLD}") == cached["v1"]
    assert resolve(f"{REPO}@main") == resolve(f"{REPO}@{MAIN}") == cached["main"]
    assert ModelConfig.from_dir(resolve(f"{REPO}@v1")).num_layers == 4
    assert (cached["v1"] / "model.safetensors").read_bytes() != (cached["main"] / "model.safetensors").read_bytes()
    assert resolve(f"{REPO}@v1", revision="v1") == cached["v1"]  # the same revision twice is one revision
    with pytest.raises(RevisionError, match=rf"^'main' disagrees with '{REPO}@v1', which names revision 'v1'"):
        resolve(f"{REPO}@v1", revision="main")
    with pytest.raises(UnknownModelError, match=r"a branch, tag or commit after the '@'"):
        resolve(f"{REPO}@")
    with pytest.raises(RevisionError, match=r"^must not be empty"):
        resolve(REPO, revision=" ")


def test_only_an_id_takes_a_revision(tmp_path: Path, cached: dict[str, Path]) -> None:
    with pytest.raises(RevisionError, match=r"^'smollm2-135m-instruct' is not a Hugging Face model id"):
        resolve("smollm2-135m-instruct", revision="v1")
    with pytest.raises(RevisionError, match=r"is a path here: only Hugging Face ids take a revision"):
        resolve(tmp_path, revision="v1")
    with pytest.raises(UnknownModelError, match=r"^'gpt2' is not a Hugging Face model id") as e:
        resolve("gpt2@v1")
    assert not isinstance(e.value, RevisionError)  # no separate revision was given: the name is what is wrong


def test_a_missing_id_or_revision_names_the_id_the_revision_and_the_cache(hub_cache: Path,
                                                                          cached: dict[str, Path]) -> None:  # fmt: skip
    with pytest.raises(UnknownModelError) as e:
        resolve("tiny-org/absent")
    assert str(e.value) == (
        f"Hugging Face model 'tiny-org/absent' (revision 'main') is not in the cache {hub_cache}, and HF_HUB_OFFLINE "
        f"is set: run once with network access to fetch it, or point HF_HOME (or HF_HUB_CACHE) at a cache that holds it"
    )
    missing_revision = rf"^Hugging Face model '{REPO}' \(revision 'v9'\) is not in the cache {hub_cache}, and "
    with pytest.raises(UnknownModelError, match=missing_revision):
        resolve(f"{REPO}@v9")


def test_a_snapshot_without_its_weights_is_refused(hub_cache: Path, checkpoints: dict[str, Path]) -> None:
    add_revision(hub_cache, REPO, checkpoints["main"], MAIN, skip=("model.safetensors",))
    with pytest.raises(UnknownModelError, match=r"revision 'main'\): model.safetensors missing from .* incomplete"):
        resolve(REPO)


def test_a_sharded_checkpoint_needs_every_file_its_index_lists(hub_cache: Path, checkpoints: dict[str, Path]) -> None:
    shards = sorted(p.name for p in checkpoints["sharded"].glob("model-*.safetensors"))
    assert len(shards) > 1 and (checkpoints["sharded"] / "model.safetensors.index.json").is_file()
    path = add_revision(hub_cache, "tiny-org/sharded", checkpoints["sharded"], MAIN)
    assert resolve("tiny-org/sharded") == path
    add_revision(hub_cache, "tiny-org/partial", checkpoints["sharded"], MAIN, skip=(shards[-1],))
    with pytest.raises(UnknownModelError, match=rf"'tiny-org/partial' \(revision 'main'\): {shards[-1]} missing"):
        resolve("tiny-org/partial")


def test_names_that_are_not_ids() -> None:
    assert hub.is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct") and hub.is_repo_id("meta-llama/Llama-3.1-8B")
    for name in ("gpt2", "a/b/c", "/abs/dir", "./rel", "~/models/x", "org/-x", "org/x.", "org/a--b", "org/a..b",
                 "org/", "org/x.git", "org/x y"):  # fmt: skip
        assert not hub.is_repo_id(name), name
    assert hub.split_revision("org/x@refs/pr/1") == ("org/x", "refs/pr/1")
    assert hub.split_revision("org/x") == ("org/x", None)
    assert hub.model_name("/data/models/smollm2-135m-instruct") == "smollm2-135m-instruct"


def test_settings_follow_the_hub_variables(tmp_path: Path) -> None:
    s = hub.HubSettings.from_env({"HF_HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": "/x"})
    assert s == hub.HubSettings(tmp_path / "home" / "hub", offline=False)
    s = hub.HubSettings.from_env({"HF_HUB_CACHE": "/c", "HF_HOME": "/h", "HF_HUB_OFFLINE": "yes"})
    assert (s.cache_dir, s.offline) == (Path("/c"), True)
    assert hub.HubSettings.from_env({"XDG_CACHE_HOME": "/x"}).cache_dir == Path("/x/huggingface/hub")
    assert hub.HubSettings.from_env({"TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "0"}).offline is False


def test_a_directory_of_that_name_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       cached: dict[str, Path]) -> None:  # fmt: skip
    (tmp_path / REPO).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve(REPO) == Path(REPO)


# -- every command ------------------------------------------------------------------------------------------


# (the model as given, the revision apart or None, the revision it resolves to)
FORMS = {"id": (REPO, None, "main"), "id@rev": (f"{REPO}@v1", None, "v1"), "id --revision": (REPO, "v1", "v1")}
COMMANDS = ["coordinator", "up", "plan", "generate", "model pull", "plan --manifest", "up --manifest",
            "coordinator --manifest"]  # fmt: skip
CASES = [pytest.param(c, f, id=f"{c}: {f}") for c in COMMANDS for f in FORMS]


def _resolved_by(command: str, name: str, revision: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str]) -> tuple[Path, str]:  # fmt: skip
    """What `command` makes of the model `name` (with `revision`), through its own flags and configuration, without
    starting a service: the directory the services get, and the name clients call the model by."""
    rev = ["--revision", revision] if revision else []
    if command.endswith("--manifest"):
        manifest = tmp_path / "mesh.yaml"
        model = {"path": name, **({"revision": revision} if revision else {})}
        manifest.write_text(json.dumps({"model": model, "parallelism": {"pipeline": 2, "tensor": 1}}))
    if command == "coordinator":
        cfg = coordinator_app.build_config(_coordinator_args(["--model", name, *rev]))
        return Path(cfg.model.path), cfg.model.name
    if command == "coordinator --manifest":
        args = coordinator_app.from_manifest(_coordinator_args(["--manifest", str(manifest)]), _coordinator_args([]))
        cfg = coordinator_app.build_config(args)
        return Path(cfg.model.path), cfg.model.name
    if command in ("up", "up --manifest"):
        started: list[tuple[argparse.Namespace, Path]] = []
        monkeypatch.setattr(up, "run", lambda args, model_dir, demo=None: started.append((args, model_dir)) or 0)
        argv = ["--manifest", str(manifest)] if command == "up --manifest" else ["--model", name, *rev]
        assert main(["up", *argv]) == 0
        ((args, model_dir),) = started
        flags = up._http_flags(up.LocalMesh(tmp_path), args)  # what the gateway is started with
        return model_dir, flags[flags.index("--served-model-name") + 1]
    if command == "plan":
        assert main(["plan", "--model", name, *rev, "--devices", "2x1GiB", "--pp", "2", "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert [r["layers"] for r in plan["shards"]] == ([[0, 2], [2, 4]] if "v1" in (name + str(revision)) else
                                                         [[0, 1], [1, 2]])  # v1 has 4 layers, main 2  # fmt: skip
        return Path(plan["model"]["path"]), plan["model"]["name"]
    if command == "plan --manifest":
        assert main(["plan", "--manifest", str(manifest)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"model: {REPO}; ")  # named by its id, not by the snapshot's commit
        coordinator = next(line for line in out.splitlines() if "shardmesh coordinator" in line).split()
        gateway = next(line for line in out.splitlines() if "shardmesh gateway" in line).split()
        return Path(coordinator[coordinator.index("--model") + 1]), gateway[gateway.index("--served-model-name") + 1]
    if command == "generate":
        ran: list[Path] = []
        monkeypatch.setattr(offline, "generate_local", lambda model_dir, *a, **kw: ran.append(model_dir) or
                            offline.OfflineResult([5], [-0.5], "length"))  # fmt: skip
        assert main(["generate", "--model", name, *rev, "--token-ids", "1,2", "--max-new-tokens", "1", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == [5]
        return ran[0], name
    assert command == "model pull"
    assert main(["model", "pull", name, *rev]) == 0
    return Path(capsys.readouterr().out.strip()), name


def _coordinator_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    coordinator_app.add_arguments(parser)
    return parser.parse_args(["--listen", "127.0.0.1:0", *argv])


@pytest.mark.parametrize(("command", "form"), CASES)
def test_every_command_takes_an_id_and_its_revision(command: str, form: str, cached: dict[str, Path],
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """`coordinator`, `up`, `plan`, `generate`, `model pull` and a manifest's `model` resolve a Hugging Face id (at a
    revision given after '@' or apart) to the same cached snapshot, and name the model as it was given."""
    name, revision, expected = FORMS[form]
    model_dir, served = _resolved_by(command, name, revision, tmp_path, monkeypatch, capsys)
    assert model_dir.resolve() == cached[expected].resolve()
    if command == "plan":
        assert served == REPO  # the plan names the model by its id
    elif command == "coordinator --manifest":  # the services get the directory; the gateway, the name as written
        assert served == str(model_dir)  # (`shardmesh plan --manifest` prints its --served-model-name)
    else:
        assert served == name  # as given: the model id of the HTTP API


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_the_commands_describe_the_model_flags_alike() -> None:
    """One help text for `--model` and `--revision` on `up`, `plan`, `generate`, `coordinator` and `model pull`."""
    commands = _subcommands(build_parser())
    parsers = {"model pull": _subcommands(commands["model"])["pull"], "up": commands["up"], "plan": commands["plan"],
               "generate": commands["generate"], "coordinator": commands["coordinator"]}  # fmt: skip
    for command, parser in parsers.items():
        actions = {a.dest: a for a in parser._actions}
        assert hub.MODEL_HELP in actions["name" if command == "model pull" else "model"].help, command
        assert actions["revision"].help.startswith(hub.REVISION_HELP), command  # env flags add " [env ...]"


@pytest.mark.parametrize("command", [["up"], ["plan", "--devices", "1x1GiB"], ["generate", "--token-ids", "1"],
                                     ["model", "pull"]])  # fmt: skip
def test_a_revision_that_disagrees_is_a_usage_error_naming_the_flag(
    command: list[str], cached: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = [f"{REPO}@v1"] if command[0] == "model" else ["--model", f"{REPO}@v1"]
    assert main([*command, *model, "--revision", "main"]) == 2
    assert capsys.readouterr().err == (f"error: --revision: 'main' disagrees with '{REPO}@v1', which names revision "
                                       f"'v1': give the revision once\n")  # fmt: skip


def test_a_manifest_names_the_field_of_a_bad_revision(tmp_path: Path, cached: dict[str, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    manifest = tmp_path / "mesh.yaml"
    manifest.write_text(json.dumps({"model": {"path": f"{REPO}@v1", "revision": "main"}}))
    assert main(["plan", "--manifest", str(manifest)]) == 2
    assert capsys.readouterr().err == (f"error: {manifest}: model.revision: 'main' disagrees with '{REPO}@v1', "
                                       f"which names revision 'v1': give the revision once\n")  # fmt: skip
    assert main(["up", "--manifest", str(manifest), "--revision", "v1"]) == 2
    assert capsys.readouterr().err == "error: --revision: the manifest sets the model (model.path, model.revision)\n"


@pytest.mark.parametrize("command", [["plan", "--devices", "1x1GiB"], ["coordinator"], ["generate", "hi"],
                                     ["up"], ["model", "pull"], ["plan", "--manifest"]])  # fmt: skip
def test_every_command_refuses_a_missing_id_in_one_line(command: list[str], hub_cache: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    missing = (f"Hugging Face model 'tiny-org/absent' (revision 'v2') is not in the cache {hub_cache}, and "
               f"HF_HUB_OFFLINE is set: run once with network access to fetch it, or point HF_HOME (or HF_HUB_CACHE) "
               f"at a cache that holds it")  # fmt: skip
    if command == ["plan", "--manifest"]:
        manifest = tmp_path / "mesh.yaml"
        manifest.write_text(json.dumps({"model": {"path": "tiny-org/absent", "revision": "v2"}}))
        assert main([*command, str(manifest)]) == 2
        assert capsys.readouterr().err == f"error: {manifest}: model.path: {missing}\n"
        return
    if command == ["model", "pull"]:
        assert main([*command, "tiny-org/absent@v2"]) == 2
        assert capsys.readouterr().err == f"error: MODEL: {missing}\n"
        return
    assert main([command[0], "--model", "tiny-org/absent@v2", *command[1:]]) == 2
    assert capsys.readouterr().err == f"error: --model: {missing}\n"


# -- with a network: a fake Hub on 127.0.0.1 -------------------------------------------------------------------


class FakeHub:
    """The routes `snapshot_download` uses, for one repo at one commit: revision info, the file tree, and
    HEAD/GET of each file. `fetched` lists the files whose contents were sent."""

    def __init__(self, repo_id: str, files: dict[str, bytes], commit: str) -> None:
        self.repo_id, self.files, self.commit = repo_id, files, commit
        self.fetched: list[str] = []
        hub_ = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                path = self.path.split("?")[0]
                api = f"/api/models/{hub_.repo_id}/"
                if not path.startswith((api, f"/{hub_.repo_id}/")):  # as huggingface.co answers an unknown repo
                    return self._error(401, "RepoNotFound")
                if path.startswith(api + "revision/"):
                    return self._json({"id": hub_.repo_id, "sha": hub_.commit,
                                       "siblings": [{"rfilename": f} for f in hub_.files]})  # fmt: skip
                if path.startswith(api + "tree/"):
                    return self._json([{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                                       for f, d in hub_.files.items()])  # fmt: skip
                prefix = f"/{hub_.repo_id}/resolve/{hub_.commit}/"
                name = path.removeprefix(prefix)
                if not path.startswith(prefix) or name not in hub_.files:
                    return self._error(404, "EntryNotFound")
                data = hub_.files[name]
                self.send_response(200)
                self.send_header("X-Repo-Commit", hub_.commit)
                self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    hub_.fetched.append(name)
                    self.wfile.write(data)

            def _error(self, status: int, code: str) -> None:
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _json(self, value: object) -> None:
                data = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def online(hub_cache: Path, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The sharded checkpoint on a fake Hub, beside what the mesh must never fetch: pickles, and a second copy
    of the weights under another name."""
    files = {p.name: p.read_bytes() for p in checkpoints["sharded"].iterdir()}
    files |= {"pytorch_model.bin": b"pickle", "consolidated.safetensors": b"copy", "original/params.pt": b"pickle",
              "README.md": b"# tiny"}  # fmt: skip
    with FakeHub(REPO, files, MAIN) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.delenv("HF_HUB_OFFLINE")
        yield fake


def test_with_a_network_only_what_the_mesh_reads_is_downloaded(online: FakeHub, hub_cache: Path,
                                                               checkpoints: dict[str, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    path = resolve(REPO)
    assert path == repo_folder(hub_cache, REPO) / "snapshots" / MAIN
    expected = sorted(p.name for p in checkpoints["sharded"].iterdir())  # config, generation config, index, shards
    assert sorted(online.fetched) == expected
    assert all((path / f).read_bytes() == (checkpoints["sharded"] / f).read_bytes() for f in expected)
    assert ModelConfig.from_dir(path).num_layers == 2
    # Then offline, from the cache alone.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    online.fetched.clear()
    assert resolve(REPO) == path and online.fetched == []


def test_with_a_network_a_missing_id_says_the_hub_has_no_such_model(online: FakeHub, hub_cache: Path) -> None:
    with pytest.raises(UnknownModelError, match=r"^Hugging Face model 'tiny-org/absent' \(revision 'main'\) was not "
                                                r"found on the Hub \(a private model needs HF_TOKEN\), nor in the "
                                                rf"cache {hub_cache}$"):  # fmt: skip
        resolve("tiny-org/absent")


def test_when_the_hub_cannot_be_reached_the_cache_answers(cached: dict[str, Path], hub_cache: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    with FakeHub(REPO, {}, MAIN) as gone:
        endpoint = gone.endpoint  # a port nothing listens on once it is closed
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert resolve(REPO) == cached["main"]
    unreachable = (
        rf"^Hugging Face model 'tiny-org/absent' \(revision 'main'\) is not in the cache {hub_cache}, and "
        r"the Hub could not be reached \(ConnectError: .*refused\): run once with network access"
    )
    with pytest.raises(UnknownModelError, match=unreachable):
        resolve("tiny-org/absent")
