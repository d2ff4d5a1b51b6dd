"""The gateway's documentation agrees with itself and with the server: what docs/extending.md calls not built
is what docs/gateway.md lists under "Not built yet" (it once called streaming, tool calls and outside access
unbuilt while gateway.md documented them), and gateway.md's routes are the server's."""

from __future__ import annotations

import re

from mas_async.gateway.server import Gateway
from tests.support.paths import ROOT
from tests.unit.gateway.fakes import LIMITS, POLICY_OF

GATEWAY = (ROOT / "docs" / "gateway.md").read_text()
EXTENDING = (ROOT / "docs" / "extending.md").read_text()


def _not_built_bullets() -> list[str]:
    section = GATEWAY.split("## Not built yet", 1)[1].split("\n## ", 1)[0]
    return [b.lower() for b in re.split(r"\n- ", section)[1:]]


def test_what_extending_calls_not_built_is_what_the_gateway_page_lists() -> None:
    section = EXTENDING.split("## Agents written against the OpenAI API", 1)[1].split("\n## ", 1)[0]
    said = re.search(r"not built yet \(([^)]*)\)", " ".join(section.split()))
    assert said is not None, "extending.md says where the unbuilt parts are listed"
    claim = said.group(1)
    if claim.startswith("[Not built yet](gateway.md#not-built-yet"):
        return
    bullets = _not_built_bullets()
    for item in re.split(r",\s*|\s+and\s+", claim):
        words = [w for w in re.findall(r"[a-z]+", item.lower()) if len(w) > 3]
        assert any(all(w in b for w in words) for b in bullets), f"extending.md calls {item!r} unbuilt"


def test_the_routes_table_is_the_servers_routes() -> None:
    gateway = Gateway(policy_of=POLICY_OF, tokenizers={}, generate=None, limits=LIMITS)  # type: ignore[arg-type]
    served = {f"{r.method} {r.resource.canonical}" for r in gateway.app.router.routes() if r.method != "HEAD"}
    table = GATEWAY.split("### Routes", 1)[1].split("\n\n", 2)[1]
    documented = set(re.findall(r"^\| `((?:GET|POST) /v1/[a-z/]+)`", table, re.MULTILINE))
    assert documented == served
