"""The chart trusts ``X-Forwarded-For`` only from the proxies its values name.

The probe: the API ran uvicorn with ``--forwarded-allow-ips=*``, so any client could name
its own address in ``X-Forwarded-For`` and escape the failed-login limit (which counts
per client IP). Each test renders the chart, builds uvicorn's configuration from the
rendered command line exactly as ``uvicorn`` parses it, and asks uvicorn's own proxy
middleware which client address the service would see.
"""

from __future__ import annotations

import asyncio
from typing import Any

import helm_python as helm
import pytest

from tests.deploy.chart import env_of, one, render
from tests.deploy.test_helm_chart import FULL

SPOOFED = "192.0.2.250"


def api_container(values: dict[str, Any]) -> dict[str, Any]:
    import yaml

    docs = tuple(d for path, text in render(values).items() if path.endswith(".yaml")
                 for d in yaml.safe_load_all(text) if d)
    return one(docs, "Deployment", f"{FULL}-api")["spec"]["template"]["spec"]["containers"][0]


def client_seen(command: list[str], peer: str, forwarded_for: str) -> str:
    """The client address the API app sees when ``peer`` connects, saying ``forwarded_for``."""
    import uvicorn
    from uvicorn.main import main as uvicorn_cli

    assert command[0] == "uvicorn"
    params = uvicorn_cli.make_context("uvicorn", command[1:]).params
    seen: list[str] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        seen.append(scope["client"][0])

    config = uvicorn.Config(app, proxy_headers=params["proxy_headers"],
                            forwarded_allow_ips=params["forwarded_allow_ips"])
    config.load()
    scope = {"type": "http", "client": (peer, 40000), "scheme": "http",
             "headers": [(b"x-forwarded-for", forwarded_for.encode())]}
    asyncio.run(config.loaded_app(scope, None, None))
    return seen[0]


def test_by_default_no_client_can_pick_its_own_address() -> None:
    container = api_container({})
    assert client_seen(container["command"], "203.0.113.9", SPOOFED) == "203.0.113.9"
    assert client_seen(container["command"], "10.0.0.7", SPOOFED) == "10.0.0.7"
    assert "TUNEFLEET_RATE_LIMIT_TRUSTED_PROXIES" not in env_of(container)


def test_the_configured_proxies_name_the_client_and_no_one_else_does(monkeypatch) -> None:
    from control.settings import Settings

    container = api_container({"api": {"trustedProxies": ["10.0.0.0/8", "fd00::1"]}})
    # The ingress controller in 10.0.0.0/8 names the client; anyone else is the client.
    assert client_seen(container["command"], "10.42.0.5", SPOOFED) == SPOOFED
    assert client_seen(container["command"], "203.0.113.9", SPOOFED) == "203.0.113.9"
    env = env_of(container)["TUNEFLEET_RATE_LIMIT_TRUSTED_PROXIES"]
    assert env == {"name": "TUNEFLEET_RATE_LIMIT_TRUSTED_PROXIES", "value": "10.0.0.0/8,fd00::1"}
    # The service's own rate limits read the same list.
    monkeypatch.setenv(env["name"], env["value"])
    assert [str(n) for n in Settings(_env_file=None).trusted_proxies] == ["10.0.0.0/8", "fd00::1/128"]


@pytest.mark.parametrize("bad", [["*"], ["proxy.internal"], "10.0.0.0/8", ["10.0.0.0/8,10.1.0.0/16"]])
def test_trusted_proxies_must_be_a_list_of_addresses_or_networks(bad: Any) -> None:
    with pytest.raises(helm.HelmError) as excinfo:
        render({"api": {"trustedProxies": bad}})
    assert "schema" in str(excinfo.value).lower() and "trustedProxies" in str(excinfo.value)
