"""An agent service outside the run: Plan-Path's two movers as a process of their own, and the workflow
program that hands it each episode.

Agents often already run as a service that takes a task and calls an OpenAI-compatible endpoint. Such a
service trains unchanged when the run's gateways are served outside the run (`gateway.external: true`,
docs/gateway.md): the workflow program `forward` makes no call itself; it posts each episode (its problem,
the gateway's base URL and the episode's API key) to the service, which plays the episode on its own copy
of the env with the `openai` package, every call going to that URL with that key, and answers with the
rewards. The gateway attributes each call to its episode by the key and records it as its agent's turn,
exactly as for a program's own calls, so the run trains on them.

    python -m nodes.examples.agent_service --port 8400        # the service: started by you, not by the run
    mas-async train configs/examples/agent_service.yaml      # workflow.options.service_url: its URL

The service's HTTP API (aiohttp):

    POST /episodes  {"episode_id", "problem", "base_url", "api_key", "max_turns", "timeout_s"}
                    -> 200 {"team", "local": {agent: reward}, "success"}, or an error {"error": message}
    GET  /stats     -> {"episodes", "failed", "calls"}: episodes played, those that failed, LLM calls made

The movers are `openai_movers.play`, the same code the run calls in process; the env is the service's
(Plan-Path, reset to the episode's problem), so the team reward and success are the service's and come
back with the local rewards. The clients are built with `max_retries=0`: a retried call would be a second
sample of the turn.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

from nodes.examples.openai_movers import play

DEFAULT_TIMEOUT_S = 600.0
"""How long one LLM call (service) or one whole episode (program) may take."""


class ServiceError(RuntimeError):
    """The agent service did not play an episode (its answer says why)."""


# -- the workflow program: runs in the env worker, once per episode ------------------------------------


async def forward(
    task: Any, agents: dict[str, Any], service_url: str, max_turns: int = 6, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dict[str, Any]:
    """Post the episode to the agent service at `service_url`; its rewards are the episode's. The clients in
    `agents` are not used: the service builds its own from `task.base_url` and `task.api_key`."""
    body = {
        "episode_id": task.episode_id,
        "problem": task.problem,
        "base_url": task.base_url,
        "api_key": task.api_key,
        "max_turns": max_turns,
        "timeout_s": timeout_s,
    }
    async with ClientSession(timeout=ClientTimeout(total=timeout_s)) as http:
        async with http.post(f"{service_url.rstrip('/')}/episodes", json=body) as response:
            answer = await response.json(content_type=None)
    if response.status != 200:
        raise ServiceError(f"the agent service at {service_url} answered {response.status}: {answer.get('error')}")
    return answer


# -- the service: a process of its own ---------------------------------------------------------------


class AgentService:
    """Plays each posted episode with the movers against the gateway it names."""

    def __init__(self) -> None:
        self.episodes = 0
        self.failed = 0
        self.calls = 0
        self.http: Any = None
        """One connection pool for every episode's clients (an SSL context per client costs ~26 ms of CPU)."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/episodes", self.episode)
        app.router.add_get("/stats", self.stats)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        from openai import DefaultAsyncHttpxClient

        async def count(_request: Any) -> None:
            self.calls += 1

        # No proxy from the environment: the gateway is reached directly at the URL each episode names.
        self.http = DefaultAsyncHttpxClient(trust_env=False, event_hooks={"request": [count]})

    async def _close(self, _app: web.Application) -> None:
        await self.http.aclose()

    async def episode(self, request: web.Request) -> web.Response:
        import openai

        from envs.plan_path import PlanPathEnv

        try:
            body = await request.json()
            problem, base_url, api_key = body["problem"], body["base_url"], body["api_key"]
            max_turns, timeout_s = int(body.get("max_turns", 6)), float(body.get("timeout_s", DEFAULT_TIMEOUT_S))
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"a bad episode: {type(e).__name__}: {e}"}, status=400)
        env = PlanPathEnv()
        env.reset(options={"problem": problem})
        agents = {
            agent: openai.AsyncOpenAI(
                base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s, http_client=self.http
            )
            for agent in env.possible_agents
        }
        self.episodes += 1
        try:
            rewards = await play(SimpleNamespace(env=env), agents, max_turns=max_turns)
        except openai.APIError as e:  # the gateway refused a call: the episode fails, the service goes on
            self.failed += 1
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=502)
        return web.json_response({"team": env.team_reward(), "local": rewards["local"], "success": env.success()})

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response({"episodes": self.episodes, "failed": self.failed, "calls": self.calls})


async def serve(host: str, port: int, url_file: Path | None) -> None:
    """Serve until SIGTERM or SIGINT; the URL is printed and, with `url_file`, written there once listening."""
    runner = web.AppRunner(AgentService().app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound_host, bound_port = runner.addresses[0][:2]
    url = f"http://{bound_host}:{bound_port}"
    print(f"agent service at {url}", flush=True)
    if url_file is not None:  # written whole, then renamed: a reader never sees half of it
        tmp = url_file.with_name(url_file.name + ".tmp")
        tmp.write_text(url)
        os.replace(tmp, url_file)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description="Plan-Path's movers as an agent service outside the run")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8400, help="port (0: a free one; default 8400)")
    parser.add_argument("--url-file", type=Path, help="write the service's URL here once it listens")
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port, args.url_file))


if __name__ == "__main__":
    main()
