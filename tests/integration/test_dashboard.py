"""The status page in a real headless Chromium (Debian's chromium + chromedriver, driven by selenium).

Against a live cluster: the page lists every instance and both nodes' pools, and after requests
it shows their routing decisions and a higher completed count. Against a bare nats-server with a
stand-in conductor: a silent conductor, then a silent messenger, are shown as unavailable and the
page still renders; with API keys on, a tenant's key shows its own decisions and nothing of the
cluster, an operator's everything.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import time
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from common import bus
from common.security import hash_key
from schemas import subjects
from schemas.events import Event
from schemas.workers import StatusReply, WorkerInfo
from services.gateway.dashboard import Dashboard
from services.gateway.tenants import KeyBook
from tests import required
from tests.integration.conftest import bare_nats_server, post
from tools.moonbus.cluster.processes import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1400,1000")


def _why_no_browser() -> str:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        return (f"no headless browser here ({', '.join(missing)} missing): `make test` installs Debian's "
                "chromium and chromium-driver with apt-get")
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed: `make setup` installs the test extra of pyproject.toml"
    return ""


pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def browser_here() -> None:
    if _why_no_browser():
        required.missing("browser", _why_no_browser())


class Page:
    """A browser tab, used from async tests: every WebDriver call runs in a thread, so a server in
    this process (the stand-in test) keeps answering while the browser waits on it."""

    def __init__(self, driver) -> None:
        self.driver = driver

    async def open(self, url: str) -> None:
        await asyncio.to_thread(self.driver.get, url)

    async def js(self, expression: str):
        return await asyncio.to_thread(self.driver.execute_script, f"return ({expression});")

    async def wait_for(self, expression: str, timeout_s: float = 30.0):
        """Poll until the JS expression is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                text = await self.js("document.body.innerText")
                raise AssertionError(f"the page never showed {expression!r}; it reads:\n{text[:3000]}")
            await asyncio.sleep(0.25)

    async def text(self, selector: str) -> str:
        return await self.js(f"(document.querySelector({selector!r}) || {{textContent: ''}}).textContent.trim()")

    async def updates(self) -> int:
        return int(await self.js("document.body.dataset.updates || 0"))


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    from selenium import webdriver

    profile = tmp_path_factory.mktemp("chromium-profile")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER, log_output=subprocess.DEVNULL)
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield Page(driver)
    finally:
        driver.quit()


def row(instance_id: str, column: int) -> str:
    return f'#instances tr[data-instance="{instance_id}"] td:nth-child({column})'


# --- against the live cluster ----------------------------------------------------------------------

async def test_the_page_lists_the_cluster_and_follows_its_requests(cluster, page):
    url = cluster.spec.url
    await page.open(f"{url}/dashboard")
    assert await asyncio.to_thread(lambda: page.driver.title) == "moonbus dashboard"
    await page.wait_for("document.body.dataset.updates >= 1")
    assert await page.text("#conductor") == "available"
    assert await page.text("#model") == "tiny-random"
    # every instance, with its role and node
    await page.wait_for("document.querySelector('#instances tr[data-instance=\"decode-0\"]')")
    for instance_id, role, node in (("prefill-0", "prefill", "node-p0"), ("decode-0", "decode", "node-d0"),
                                    ("messenger-p0", "messenger", "node-p0"), ("messenger-d0", "messenger", "node-d0")):
        assert (await page.text(row(instance_id, 2)), await page.text(row(instance_id, 3))) == (role, node)
    # both nodes' pools, with their tiers' capacities
    for node in ("node-p0", "node-d0"):
        card = f'#nodes .node[data-node="{node}"]'
        assert await page.js(f"document.querySelector('{card}').dataset.available") == "true"
        assert "DRAM" in await page.text(card) and "SSD" in await page.text(card)
        dram = await page.text(f"{card} .bar.dram em")
        used, capacity = (int(x) for x in dram.split(" / "))
        assert capacity > 0 and 0 <= used <= capacity

    completed_before = int(await page.text("#count-completed"))
    request_ids = []
    for i in range(2):
        status, body, headers = await post(f"{url}/v1/completions", {"model": "tiny-random", "max_tokens": 3, "ignore_eos": True,
                                                                      "prompt": f"dashboard request {i} " * 3})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 3
        request_ids.append(headers["X-Request-Id"])

    # the page catches up by itself: the completed count, then each request's decision
    await page.wait_for(f"Number(document.getElementById('count-completed').textContent) >= {completed_before + 2}")
    assert float(await page.text("#goodput-rate")) > 0
    # the completed requests' TTFT against its prediction, as points over time
    await page.wait_for("document.querySelectorAll('#ttft-error circle').length >= 1")
    assert float(await page.js("document.querySelector('#ttft-error circle title').textContent")) > 0
    for rid in request_ids:
        decision = f'#decisions details[data-request-id="{rid}"]'
        await page.wait_for(f"document.querySelector('{decision}')")
        assert await page.text(f"{decision} .route") == "prefill-0 → decode-0"
        assert await page.text(f"{decision} .badge") == "admitted"
        assert "TTFT" in await page.text(f"{decision} summary")
    # unfolded, a decision shows every candidate with its predicted costs, the chosen ones marked
    newest = f'#decisions details[data-request-id="{request_ids[-1]}"]'
    await page.js(f"document.querySelector('{newest}').open = true")
    chosen = await page.js(f"[...document.querySelectorAll('{newest} tr.chosen td:first-child')].map(e => e.textContent)")
    assert chosen == ["prefill-0", "decode-0"]
    cells = await page.js(f"[...document.querySelectorAll('{newest} tr.chosen')[0].cells].map(e => e.textContent)")
    assert len(cells) == 7 and cells[-1].endswith(("ms", " s"))  # queue, prefix, pull, prefill, transfer, TTFT
    # the open decision stays open across the next redraws
    seen = await page.updates()
    await page.wait_for(f"document.body.dataset.updates >= {seen + 2}")
    assert await page.js(f"document.querySelector('{newest}').open") is True

    # the JSON the page polls says the same
    state = await get_state(url)
    assert {w["instance_id"] for w in state["instances"]} >= {"prefill-0", "decode-0", "messenger-p0", "messenger-d0"}
    assert [n["node"] for n in state["nodes"]] == ["node-d0", "node-p0"]
    assert {d["request_id"] for d in state["decisions"]} >= set(request_ids)
    assert len(state["outcomes"]["points"]["completed"]) == 300
    assert len(state["ttft_error"]["points"]) == 300 and any(r is not None and r > 0 for r in state["ttft_error"]["points"])
    assert state["outcomes"]["totals"]["completed"] >= completed_before + 2


# --- a cluster that does not answer ------------------------------------------------------------------

@pytest.fixture
async def bare_nats(tmp_path):
    port = free_port()
    proc = bare_nats_server(port)
    try:
        nc = await bus.connect(f"nats://127.0.0.1:{port}", "test-dashboard", first_connect_timeout_s=20)
        yield nc
        await nc.drain()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
async def dashboard_only(bare_nats):
    """The dashboard's routes on their own, as the gateway serves them, over the bare nats-server."""
    keys = KeyBook("")  # an open gateway: everyone may look
    gateway = SimpleNamespace(nc=bare_nats, served_model="tiny-random", cfg=SimpleNamespace(instance_id="gateway-t"),
                              authenticate=keys.tenant_of, keys=keys)
    app = web.Application()
    Dashboard(gateway).add_routes(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_a_silent_conductor_or_messenger_shows_as_unavailable(bare_nats, dashboard_only, page):
    await page.open(f"{dashboard_only}/dashboard")
    await page.wait_for("document.body.dataset.updates >= 1", timeout_s=15)
    assert await page.text("#conductor") == "unavailable"
    assert "unavailable" in await page.text("#instances tbody")
    assert await page.text("#count-completed") == "0"

    # a stand-in conductor that knows a messenger on node-ghost, which nobody answers for
    workers = [WorkerInfo("prefill-0", "prefill", "node-p0", num_queued=1),
               WorkerInfo("messenger-g", "messenger", "node-ghost")]
    reply = StatusReply(workers, in_flight=1, prefill_queue_s={"prefill-0": 0.25}).to_bytes()

    async def answer(msg) -> None:
        await bare_nats.publish(msg.reply, reply)

    async def never(msg) -> None:  # there, but too busy to answer: the page waits one query timeout
        pass

    sub = await bare_nats.subscribe(subjects.CONDUCTOR_STATUS, cb=answer)
    silent = await bare_nats.subscribe(subjects.messenger_control("node-ghost", "status"), cb=never)
    try:
        await page.wait_for("document.getElementById('conductor').textContent === 'available'", timeout_s=15)
        await page.wait_for("document.querySelector('#nodes .node[data-node=\"node-ghost\"]')", timeout_s=15)
        ghost = '#nodes .node[data-node="node-ghost"]'
        assert await page.js(f"document.querySelector('{ghost}').dataset.available") == "false"
        assert "unavailable: no answer" in await page.text(ghost)
        assert await page.text(row("prefill-0", 6)) == "250.0 ms"  # the predicted queue
        assert await page.text("#in-flight") == "1"
        # it answers at all: bounded by the query timeout, not by the messenger that never answers
        state = await get_state(dashboard_only)
        assert state["nodes"] == [{"node": "node-ghost", "available": False, "error": "no answer (TimeoutError)"}]
    finally:
        await silent.unsubscribe()
        await sub.unsubscribe()
    # the conductor is gone again: so is everything it knew, and the page says so
    await page.wait_for("document.getElementById('conductor').textContent === 'unavailable'", timeout_s=15)
    assert "unavailable" in await page.text("#nodes")


@pytest.fixture
async def keyed_dashboard(bare_nats, tmp_path):
    """The dashboard's routes over the bare nats-server with API keys on: tenant acme's key, tenant
    globex's and an operator's. Yields (its URL, the Dashboard)."""
    key_file = tmp_path / "api-keys.json"
    key_file.write_text(json.dumps({"keys": [{"hash": hash_key("mb-acme"), "tenant": "acme"},
                                             {"hash": hash_key("mb-globex"), "tenant": "globex"},
                                             {"hash": hash_key("mb-ops"), "tenant": "ops", "operator": True}]}))
    keys = KeyBook(str(key_file))
    gateway = SimpleNamespace(nc=bare_nats, served_model="tiny-random", cfg=SimpleNamespace(instance_id="gateway-t"),
                              authenticate=keys.tenant_of, keys=keys)
    app = web.Application()
    dashboard = Dashboard(gateway)
    dashboard.add_routes(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", dashboard
    await runner.cleanup()


async def test_a_tenants_page_shows_its_own_decisions_and_nothing_of_the_cluster(keyed_dashboard, page):
    url, dashboard = keyed_dashboard
    for rid, tenant in (("req-acme", "acme"), ("req-globex", "globex")):
        costs = {"prefill_costs": [{"instance_id": "prefill-0", "queue_s": 0.4}],
                 "decode_costs": [{"instance_id": "decode-0", "num_running": 7}]}
        dashboard.decisions.add(Event("routed", time.time(), "conductor", "conductor-0", rid,
                                      {"prefill_id": "prefill-0", "decode_id": "decode-0", "admitted": True,
                                       "tenant": tenant, **costs}))
    for outcome, tenant, times in (("completed", "acme", 2), ("failed", "globex", 3), ("completed", "globex", 5)):
        for _ in range(times):
            dashboard.record(outcome, tenant)
    visible = "[...document.querySelectorAll('.cluster-only')].map(e => e.offsetParent !== null)"
    try:
        for key in ("mb-acme", "mb-ops"):
            await page.open(f"{url}/no-page")  # the origin, without the page: its key goes in first
            await page.js(f"sessionStorage.setItem('moonbus-key', '{key}')")
            await page.open(f"{url}/dashboard")
            await page.wait_for("document.body.dataset.updates >= 1", timeout_s=15)
            await page.wait_for("document.querySelector('#decisions details')", timeout_s=15)
            shown = await page.js("[...document.querySelectorAll('#decisions details')].map(e => e.dataset.requestId)")
            if key == "mb-acme":
                assert shown == ["req-acme"]
                assert await page.js(visible) == [False] * 4  # conductor, instances, pools, TTFT error
                assert await page.text("#scope") == "tenant acme: your requests only"
                # its own outcomes, not globex's
                assert await page.text("#outcomes-whose") == "Outcomes of your requests at this gateway"
                assert [await page.text(f"#count-{o}") for o in ("completed", "failed")] == ["2", "0"]
                await page.js("document.querySelector('#decisions details').open = true")
                assert await page.js("document.querySelectorAll('#decisions tr').length") == 0
                assert "operator" in await page.text("#decisions details")
            else:  # an operator's key: every tenant's decisions and their candidates, and the cluster
                assert sorted(shown) == ["req-acme", "req-globex"]
                assert await page.js(visible) == [True] * 4
                assert [await page.text(f"#count-{o}") for o in ("completed", "failed")] == ["7", "3"]  # every tenant's
                assert await page.js("document.getElementById('scope').offsetParent") is None
                assert await page.js("document.querySelectorAll('#decisions tr.chosen').length") == 4
    finally:
        await page.js("sessionStorage.removeItem('moonbus-key')")


async def get_state(url: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(f"{url}/dashboard/state") as resp:
            assert resp.status == 200 and resp.headers["Cache-Control"] == "no-store"
            return await resp.json()
