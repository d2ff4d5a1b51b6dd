"""A gateway served outside the run (`gateway.external`, mas_async/gateway/access.py): the run token (minted
0600, read back, compared in constant time), the API key `<token>.<episode key>` and its parsing, and a live
gateway that refuses every request without the token with an OpenAI-shaped 401 (counted, logged at a
bounded rate) while serving the episode's calls; where it listens (its node's address, not loopback)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from mas_async.config import ConfigError, load_config
from mas_async.deployment import Deployment
from mas_async.gateway import access as access_module
from mas_async.gateway.access import Access, TokenError, bearer, listener, mint_token, read_token
from mas_async.gateway.server import Gateway
from mas_async.gateway.session import Session
from mas_async.launch.engines.base import Engine, Node, ProcessSpec
from mas_async.launch.launcher import prepare_deployment
from mas_async.tiny_model import build_tokenizer
from tests.support.addresses import accepts, node_address
from tests.support.paths import ROOT
from tests.unit.gateway.fakes import LIMITS, POLICY_OF, FakeInference, chat, refused

TOKEN = "tok-" + "x" * 40
CONFIG = ROOT / "configs" / "examples" / "agent_service.yaml"


# -- the token and the key ---------------------------------------------------------------------------


def test_the_token_is_minted_private_and_new_at_each_start(tmp_path) -> None:
    path = mint_token(tmp_path)
    assert path == tmp_path / "keys" / "gateway_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    first = read_token(path)
    assert len(first) >= 40 and "." not in first
    assert read_token(mint_token(tmp_path)) != first  # replaced at each start of the run
    assert [p.name for p in path.parent.iterdir()] == ["gateway_token"]  # no temporary file left
    with pytest.raises(TokenError, match="cannot read the run's gateway token"):
        read_token(tmp_path / "nowhere")
    (tmp_path / "bad").write_text("a.b\n")
    with pytest.raises(TokenError, match="does not hold a gateway token"):
        read_token(tmp_path / "bad")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None, reason="needs root to run as nobody")
def test_another_user_cannot_read_the_token_even_through_an_open_folder() -> None:
    """As the unprivileged user `nobody`, in a run folder anyone may enter: the keys folder (0700) stops the
    read, and with that folder opened up the file's own mode (0600) still does."""
    run_dir = Path(tempfile.mkdtemp(prefix="token-", dir="/tmp"))
    try:
        run_dir.chmod(0o755)
        path = mint_token(run_dir)

        def nobody_reads() -> subprocess.CompletedProcess:
            return subprocess.run(["runuser", "-u", "nobody", "--", "cat", str(path)], capture_output=True, text=True,
                                  timeout=30)  # fmt: skip

        for keys_mode in (0o700, 0o755):
            path.parent.chmod(keys_mode)
            denied = nobody_reads()
            assert denied.returncode != 0 and "Permission denied" in denied.stderr, (keys_mode, denied)
            assert read_token(path) not in denied.stdout
        path.chmod(0o644)  # (the check above can fail: a readable token is read)
        assert nobody_reads().stdout.strip() == read_token(path)
    finally:
        shutil.rmtree(run_dir)


def test_the_api_key_is_the_token_then_the_episode_key() -> None:
    assert Access().api_key("mas-abc") == "mas-abc"  # loopback: the episode key alone, as before
    external = Access(TOKEN)
    key = external.api_key("mas-abc")
    assert key == f"{TOKEN}.mas-abc"
    assert external.episode_key(f"Bearer {key}") == "mas-abc"
    assert external.episode_key(f"bearer   {key} ") == "mas-abc"  # the scheme in any case, spaces around
    assert external.episode_key(f"Bearer {TOKEN}") is None and external.episode_key(f"Bearer {TOKEN}.") is None
    assert Access().episode_key("Bearer mas-abc") == "mas-abc"
    assert bearer("") is None and bearer("Basic abc") is None and bearer("Bearer ") is None
    with pytest.raises(TokenError):
        Access("a.b")


def test_admission_needs_the_token_and_counts_each_refusal(monkeypatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = access_module.hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(access_module.hmac, "compare_digest", recording)
    external = Access(TOKEN)
    external.admit(f"Bearer {TOKEN}.mas-abc", "10.0.0.9")
    external.admit(f"Bearer {TOKEN}", "10.0.0.9")  # the token alone passes here (then: no episode, a 404)
    assert external.refused == 0
    for header in ["", "Basic x", "Bearer mas-abc", f"Bearer {TOKEN[:-1]}.mas-abc", f"Bearer {TOKEN}x.mas-abc"]:
        with pytest.raises(access_module.GatewayError) as refusal:
            external.admit(header, "10.0.0.9")
        assert refusal.value.status == 401 and refusal.value.code == "invalid_api_key"
    assert external.refused == 5
    # every token compared in constant time, the guess against the run's token
    assert all(b == TOKEN.encode() for _, b in compared) and len(compared) == 5
    assert external.take_refused() == 5 and external.take_refused() == 0
    Access().admit("", None)  # loopback: nothing is checked here (the session key is, by the session)


def test_a_flood_of_refusals_writes_a_few_lines_with_counts(caplog) -> None:
    external = Access(TOKEN)
    with caplog.at_level(logging.WARNING, logger="mas_async.gateway.access"):
        for _ in range(100):
            with pytest.raises(access_module.GatewayError):
                external.admit("Bearer wrong.mas-abc", "10.0.0.9")
    lines = [r.getMessage() for r in caplog.records]
    assert 5 <= len(lines) <= 8, lines  # the 1st, 2nd, 4th, ..., 64th
    assert "10.0.0.9" in lines[0] and "not the run's token" in lines[0] and "(64 such so far" in lines[-1]
    assert external.refused == 100


# -- a live external gateway -------------------------------------------------------------------------

Test = Callable[[Gateway, Session, FakeInference, httpx.AsyncClient], Awaitable[None]]


def serve_external(test: Test, host: str = "127.0.0.1") -> None:
    """Run `test` against a started gateway that needs the run token, with one open session."""

    async def main() -> None:
        fake = FakeInference(build_tokenizer())
        gateway = Gateway(
            policy_of=POLICY_OF,
            tokenizers={"pv": fake.tokenizer, "ph": fake.tokenizer},
            generate=fake,
            limits=LIMITS,
            host=host,
            access=Access(TOKEN),
        )
        await gateway.start()
        session = gateway.open(episode_id="train0-1", problem_id="p1", mode="train")
        try:
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10.0, trust_env=False) as http:
                await asyncio.wait_for(test(gateway, session, fake, http), 60)
        finally:
            await gateway.stop()

    asyncio.run(main())


def test_the_openai_client_calls_with_the_token_and_every_other_key_is_refused() -> None:
    import openai

    async def test(gateway: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        key = gateway.api_key(session)
        assert key == f"{TOKEN}.{session.key}"
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=10.0)
        reply = await client.chat.completions.create(model="vertical", messages=[{"role": "user", "content": "GO"}])
        assert reply.choices[0].message.content == "UD" and reply.model_extra["mas_async"]["episode_id"] == "train0-1"
        assert [(c.agent, c.turn) for c in session.calls] == [("vertical", 0)]
        post = http.post
        # No token, or another: 401 before anything else (an unknown route or a huge body included).
        for headers in [{}, {"Authorization": f"Bearer {session.key}"}, {"Authorization": f"Bearer x{key}"}]:
            error = refused(await post("/chat/completions", json=chat(), headers=headers), 401)
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert refused(await http.get("/nowhere"), 401)["code"] == "invalid_api_key"
        refused(await post("/chat/completions", json=chat(), headers={"Authorization": b"Bearer \xff\xfe.mas"}), 401)
        refused(await post("/chat/completions", content=b"x" * (65 * 1024)), 401)
        assert gateway.access.refused == 6
        # The token, but no open episode of this gateway: the caller's mistake, a 404 (not counted).
        for bad in [TOKEN, f"{TOKEN}.", f"{TOKEN}.mas-nothing"]:
            error = refused(
                await post("/chat/completions", json=chat(), headers={"Authorization": f"Bearer {bad}"}), 404
            )
            assert error["code"] == "episode_not_found"
        assert refused(await http.get("/nowhere", headers={"Authorization": f"Bearer {key}"}), 404)["code"] is None
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=gateway.base_url, api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.NotFoundError, match="names no open episode"):
            await openai.AsyncOpenAI(base_url=gateway.base_url, api_key=f"{TOKEN}.mas-x", max_retries=0).models.list()
        assert gateway.access.refused == 7 and len(fake.requests) == 1  # nothing refused reached inference
        gateway.close(session)
        with pytest.raises(openai.ConflictError, match="has ended"):
            await client.chat.completions.create(model="vertical", messages=[{"role": "user", "content": "GO"}])
        await client.close()

    serve_external(test)


def test_an_external_gateway_listens_on_its_node_address_and_a_loopback_one_on_loopback() -> None:
    address = node_address()

    async def external(gateway: Gateway, session: Session, _f: FakeInference, http: httpx.AsyncClient) -> None:
        port = int(gateway.base_url.rsplit(":", 1)[1].split("/")[0])
        assert gateway.base_url == f"http://{address}:{port}/v1"
        assert await asyncio.to_thread(accepts, address, port)
        assert not await asyncio.to_thread(accepts, "127.0.0.1", port)  # the node's address only, not all
        response = await http.get("/models", headers={"Authorization": f"Bearer {gateway.api_key(session)}"})
        assert response.status_code == 200

    serve_external(external, host=address)

    async def loopback() -> None:
        gateway = Gateway(policy_of=POLICY_OF, tokenizers={}, generate=FakeInference(None), limits=LIMITS)
        await gateway.start()
        try:
            port = int(gateway.base_url.rsplit(":", 1)[1].split("/")[0])
            assert gateway.base_url == f"http://127.0.0.1:{port}/v1"
            assert await asyncio.to_thread(accepts, "127.0.0.1", port)
            assert not await asyncio.to_thread(accepts, address, port)
        finally:
            await gateway.stop()

    asyncio.run(loopback())


# -- where each env worker serves it ------------------------------------------------------------------


def test_each_worker_listens_where_the_deployment_says_with_the_run_token(tmp_path) -> None:
    config = load_config(CONFIG)
    token = mint_token(tmp_path)
    deployment = Deployment(
        router_endpoint="tcp://10.0.0.1:1",
        weight_ports={},
        model_paths={},
        gateways={"env_worker/0": "http://10.0.0.1:8123/v1", "env_worker/1": "http://[fd00::3]:8124/v1"},
        gateway_token=str(token),
    )
    host, port, access = listener(config, deployment, "env_worker/0", 0)
    assert (host, port, access.external) == ("10.0.0.1", 8123, True)
    assert access.api_key("mas-e") == f"{read_token(token)}.mas-e"
    assert listener(config, deployment, "env_worker/1", 1)[:2] == ("fd00::3", 8124)
    with pytest.raises(TokenError, match="names no gateway or token for env_worker/2"):
        listener(config, deployment, "env_worker/2", 2)
    loopback = load_config(CONFIG, ["gateway.external=false", "gateway.port=9000"])
    host, port, access = listener(loopback, deployment, "env_worker/1", 1)
    assert (host, port, access.external) == ("127.0.0.1", 9001, False)
    assert listener(load_config(CONFIG, ["gateway.external=false"]), deployment, "env_worker/1", 1)[1] == 0


class TwoNodes(Engine):
    """Places env_worker/1 on node n1 (10.0.0.2), everything else on n0 (10.0.0.1); records port requests."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int]] = []

    def place(self, specs: list[ProcessSpec]) -> dict[str, Node]:
        return {s.name: Node("n1", "10.0.0.2") if s.name == "env_worker/1" else Node("n0", "10.0.0.1") for s in specs}

    def free_ports(self, node: Node, count: int) -> list[int]:
        self.asked.append((node.name, count))
        return list(range(31000 if node.name == "n0" else 32000, (31000 if node.name == "n0" else 32000) + count))

    def start(self, spec, node, command, env, log_path):  # type: ignore[no-untyped-def]
        raise AssertionError("nothing is started here")


def test_the_launcher_records_each_gateway_on_its_node_and_mints_the_token(tmp_path) -> None:
    config = load_config(CONFIG, ["cluster.curve=false"])
    engine = TwoNodes()
    deployment = prepare_deployment(config, tmp_path, engine=engine)
    saved = Deployment.load(tmp_path / "deployment.json")
    assert saved.gateways == deployment.gateways
    # a port of its own node for each gateway (held, where the engine can), beside the router's and the stores'
    assert sorted(engine.asked) == [("n0", 1), ("n0", 5), ("n1", 1)]
    assert saved.gateways["env_worker/0"] in {f"http://10.0.0.1:{port}/v1" for port in range(31000, 31006)}
    assert saved.gateways["env_worker/1"] == "http://10.0.0.2:32000/v1"  # a free port of its own node
    assert saved.gateway_token == str(tmp_path / "keys" / "gateway_token")
    assert stat.S_IMODE((tmp_path / "keys" / "gateway_token").stat().st_mode) == 0o600
    assert listener(config, saved, "env_worker/1", 1)[:2] == ("10.0.0.2", 32000)
    fixed = prepare_deployment(
        load_config(CONFIG, ["cluster.curve=false", "gateway.port=9000"]), tmp_path, engine=engine
    )
    assert fixed.gateways == {"env_worker/0": "http://10.0.0.1:9000/v1", "env_worker/1": "http://10.0.0.2:9001/v1"}
    loopback = prepare_deployment(load_config(CONFIG, ["gateway.external=false"]), tmp_path, engine=engine)
    assert loopback.gateways == {} and loopback.gateway_token is None


def test_an_external_gateways_port_is_held_for_the_run_so_no_other_process_can_take_it(tmp_path) -> None:
    """The launcher's engine keeps each external gateway's port bound (SO_REUSEPORT) until the run ends: a
    process that did not set SO_REUSEPORT cannot bind it in between (it would be sent the run's token), while
    the worker's gateway binds it and serves."""
    import socket
    from urllib.parse import urlsplit

    from mas_async.launch.engines.local import LocalEngine

    config = load_config(CONFIG, ["cluster.curve=false"])
    engine = LocalEngine(config)
    try:
        deployment = prepare_deployment(config, tmp_path, engine=engine)
        url = urlsplit(deployment.gateways["env_worker/0"])
        squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with pytest.raises(OSError), squatter:
            squatter.bind((url.hostname, url.port))
        host, port, access = listener(config, deployment, "env_worker/0", 0)
        fake = FakeInference(build_tokenizer())
        gateway = Gateway(
            policy_of=POLICY_OF, tokenizers={"pv": fake.tokenizer, "ph": fake.tokenizer}, generate=fake,
            limits=LIMITS, host=host, port=port, access=access,
        )  # fmt: skip

        async def serve_once() -> None:
            assert await gateway.start() == f"http://{host}:{port}/v1"
            await gateway.stop()

        asyncio.run(serve_once())
    finally:
        engine.close()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as free:  # released with the run
        free.bind((url.hostname, url.port))


def test_an_external_gateway_needs_a_program() -> None:
    with pytest.raises(ConfigError, match="gateway.external=true serves the gateway of a workflow.program"):
        load_config(ROOT / "configs" / "plan_path_tiny.yaml", ["gateway.external=true"])


def test_the_dry_run_shows_each_external_gateway() -> None:
    from mas_async.launch.dry_run import plan_lines

    lines = plan_lines(load_config(CONFIG, ["gateway.port=9000"]))
    workers = [line for line in lines if line.startswith("env_worker/")]
    assert len(workers) == 2 and workers[1].endswith("OpenAI gateway (port 9001, run token)")
    assert not any("OpenAI gateway" in line for line in plan_lines(load_config(CONFIG, ["gateway.external=false"])))
