"""Hugging Face model ids (`policies.<p>.model: Org/Name`, `policies.<p>.revision`): resolved once by the launcher
to a snapshot folder of the hub's cache, which every process then loads; a sentence naming the policy, the id, the
revision and the cache when neither the cache nor the network has the model; `model_config` without weights.

No test reaches a network: the cache is built here in the hub's own layout (models--Org--Name/refs/<branch>,
snapshots/<commit>/<file> linking to blobs/<hash>) under a temporary HF_HOME, and the one online case points
HF_ENDPOINT at a closed local port."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from pathlib import Path

import huggingface_hub.constants
import pytest

from mas_async.config import ConfigError, load_config
from mas_async.launch.engines.base import Engine, Node, ProcessSpec
from mas_async.launch.launcher import prepare_deployment
from mas_async.model_source import ModelSourceError, model_config, resolve_model
from tests.support.paths import ROOT

REPO = "Org/Tiny-Model"
CONFIG = ROOT / "configs" / "plan_path_tiny.yaml"


def hub_cache(home: Path, repo: str, files: dict[str, str], *, branch: str = "main") -> tuple[Path, str]:
    """A snapshot of `repo` in the hub's cache layout under HF_HOME=`home`; returns its folder and commit."""
    storage = home / "hub" / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(json.dumps(files, sort_keys=True).encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        blob = hashlib.sha256(text.encode()).hexdigest()
        (storage / "blobs" / blob).write_text(text)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / branch).write_text(commit)
    return snapshot, commit


def shape(hidden: int) -> str:
    return json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden})


@pytest.fixture
def offline_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """HF_HOME in tmp_path, HF_HUB_OFFLINE=1, and the hub's endpoint a local socket that must never be called."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # As in a process that imported huggingface_hub before the flag was set (it reads it once): the flag must be
    # honoured from the environment at resolve time.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)  # "Org/Tiny-Model" is no folder here
    knocks: list[object] = []
    with socket.socket() as hub:  # answers every connection by closing it (the client fails at once), and counts
        hub.bind(("127.0.0.1", 0))
        hub.listen(8)
        hub.settimeout(0.1)

        def serve() -> None:
            while hub.fileno() >= 0:
                try:
                    connection, _ = hub.accept()
                except OSError:  # the timeout, or the socket closed
                    continue
                knocks.append(connection)
                connection.close()

        threading.Thread(target=serve, daemon=True).start()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.getsockname()[1]}")
        yield home
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        assert not knocks, "HF_HUB_OFFLINE=1, yet the hub was called"


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(offline_home: Path, tmp_path: Path) -> None:
    snapshot, commit = hub_cache(offline_home, REPO, {"config.json": shape(64), "tokenizer.json": "{}"})
    assert resolve_model(REPO, tmp_path / "models") == snapshot
    assert resolve_model(REPO, tmp_path / "models", commit) == snapshot  # a pinned commit
    assert json.loads((snapshot / "config.json").read_text())["hidden_size"] == 64
    assert model_config(REPO) == json.loads(shape(64))


def test_a_revision_picks_its_own_snapshot(offline_home: Path, tmp_path: Path) -> None:
    hub_cache(offline_home, REPO, {"config.json": shape(64)})
    other, commit = hub_cache(offline_home, REPO, {"config.json": shape(128)}, branch="v2")
    assert resolve_model(REPO, tmp_path, "v2") == other
    assert resolve_model(REPO, tmp_path, commit) == other
    assert json.loads((resolve_model(REPO, tmp_path) / "config.json").read_text())["hidden_size"] == 64


def test_a_model_in_neither_cache_nor_network_is_a_sentence(offline_home: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError) as offline:
        resolve_model("Qwen/Qwen3-1.7B", tmp_path, "abc123", policy="vertical")
    message = str(offline.value)
    for part in ("policies.vertical.model", "'Qwen/Qwen3-1.7B'", "'abc123'", str(offline_home / "hub"),
                 "HF_HUB_OFFLINE", "huggingface-cli download Qwen/Qwen3-1.7B --revision abc123"):  # fmt: skip
        assert part in message
    assert isinstance(offline.value, ConfigError)  # the CLI prints it as a sentence, exit 2


def test_online_without_the_network_is_the_same_sentence(
    offline_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:  # a port nobody listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ModelSourceError, match=r"policies.vertical.model: 'Org/Missing' at revision 'main'"):
        resolve_model("Org/Missing", tmp_path, policy="vertical")
    snapshot, _ = hub_cache(offline_home, REPO, {"config.json": shape(64)})
    assert resolve_model(REPO, tmp_path) == snapshot  # the network down, the cache answers


class OneNode(Engine):
    """Every process on one CPU node; nothing is started."""

    def place(self, specs: list[ProcessSpec]) -> dict[str, Node]:
        return {s.name: Node("node0", "127.0.0.1") for s in specs}

    def free_ports(self, node: Node, count: int) -> list[int]:
        return list(range(31000, 31000 + count))

    def start(self, spec, node, command, env, log_path):  # type: ignore[no-untyped-def]
        raise AssertionError("nothing is started here")


def test_the_launcher_hands_every_process_the_pinned_snapshot(offline_home: Path, tmp_path: Path) -> None:
    hub_cache(offline_home, REPO, {"config.json": shape(64)})
    pinned, commit = hub_cache(offline_home, REPO, {"config.json": shape(128)}, branch="v2")
    overrides = [f"policies.{p}.model={REPO}" for p in ("vertical", "horizontal")]
    config = load_config(
        CONFIG, [*overrides, f"policies.vertical.revision={commit}", "policies.horizontal.revision=v2"]
    )
    deployment = prepare_deployment(config, tmp_path / "run", engine=OneNode())
    assert deployment.model_paths == {"vertical": str(pinned), "horizontal": str(pinned)}
    saved = json.loads((tmp_path / "run" / "deployment.json").read_text())
    assert saved["model_paths"] == deployment.model_paths  # what every process reads


def test_a_revision_without_a_hub_id_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"revision 'v2' pins a Hugging Face model id .* 'builtin:tiny-char'"):
        load_config(CONFIG, ["policies.vertical.revision=v2"])


def test_model_config_reads_shapes_without_weights(offline_home: Path, tmp_path: Path) -> None:
    eight = model_config("Qwen/Qwen3-8B")  # not in this cache: the shipped shape
    assert (eight["hidden_size"], eight["num_hidden_layers"], eight["intermediate_size"]) == (4096, 36, 12288)
    assert eight["tie_word_embeddings"] is False
    assert model_config("Qwen/Qwen3-1.7B")["tie_word_embeddings"] is True
    hub_cache(offline_home, "Qwen/Qwen3-8B", {"config.json": shape(99)})
    assert model_config("Qwen/Qwen3-8B")["hidden_size"] == 99  # the cached snapshot wins
    with pytest.raises(ModelSourceError, match=r"'Org/Unknown'.*no shape shipped for it .*Qwen/Qwen3-8B"):
        model_config("Org/Unknown")
    folder = tmp_path / "local"
    folder.mkdir()
    (folder / "config.json").write_text(shape(7))
    assert model_config(str(folder))["hidden_size"] == 7


def test_model_config_of_a_builtin_is_the_file_it_writes(tmp_path: Path) -> None:
    written = resolve_model("builtin:tiny-char", tmp_path)
    assert model_config("builtin:tiny-char") == json.loads((written / "config.json").read_text())
    assert model_config("builtin:tiny-char", tmp_path) == json.loads((written / "config.json").read_text())
