"""The metrics collector's live cluster page in real headless Chromium against a running stack.

Debian's `chromium` and `chromium-driver`, driven through selenium. The page must load
without a console error, show every worker with its role, follow a worker that joins and
one that is SIGKILLed (shown as gone once its heartbeat expires), show routing decisions
and recent errors, and put strings from the network on the page as text, never as markup.
A screenshot is saved in the test's tmp dir and, when TANDEM_ARTIFACTS_DIR is set, there.

Without Chromium the test is skipped with a plain message, except under CI=true, where a
missing browser is a failure (`.ci/prepare-chromium` installs it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.bus import Bus
from shared.codec import encode
from shared.nats_server import EmbeddedNats, pid_alive
from shared.schemas import TransferRecord, WorkerRole
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import make_stack
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

PAGE_WAIT_S = 20.0
HOSTILE = '3 of 4 blocks failed <b id="injected">verification</b>'
# One atomic read of what the page shows (it re-renders every second).
WORKER_ROWS = """return Array.from(document.querySelectorAll('tr[data-worker-id]'))
    .map(row => [row.dataset.workerId, row.dataset.role, row.dataset.state]);"""


def browser_paths() -> tuple[str, str]:
    """(chromium, chromedriver), or skip / fail (CI) with a plain message."""
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    chromedriver = shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        chromium = None
    if chromium and chromedriver:
        return chromium, chromedriver
    message = ("Chromium is not installed (needs the chromium and chromium-driver packages, and selenium from the "
               "test extras; `.ci/prepare-chromium` installs them): the cluster page test did not run")
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    chromium, chromedriver = browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1440,900", "--force-prefers-reduced-motion"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def stack(browser: object, nats_server: EmbeddedNats, tiny_model_dir: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A P/D pair and a worker serving whole requests (the browser first: no stack without one)."""
    local = make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("page-stack"), workers=0,
                       specs=(WorkerSpec(worker_id="prefill-1", role=WorkerRole.PREFILL),
                              WorkerSpec(worker_id="decode-1", role=WorkerRole.DECODE),
                              WorkerSpec(worker_id="worker-1", role=WorkerRole.BOTH)),
                       router_args=("--local-prefill-tokens", "64"))  # longer prompts go through a KV hand-off
    local.start()
    yield local
    pids = [process.pid for process in local.processes.values()]
    local.stop()
    assert not [pid for pid in pids if pid_alive(pid)], "processes left behind"


def shown_workers(driver) -> dict[str, tuple[str, str]]:  # type: ignore[no-untyped-def]
    """worker id -> (role, state) as the page shows them; state is the status or "gone"."""
    return {worker_id: (role, state) for worker_id, role, state in driver.execute_script(WORKER_ROWS)}


def console_errors(driver) -> list[str]:  # type: ignore[no-untyped-def]
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def save_screenshot(driver, path: Path) -> Path:  # type: ignore[no-untyped-def]
    """The whole page, as tall as its content."""
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1440, "height": min(height, 3000), "deviceScaleFactor": 1, "mobile": False})
    driver.save_screenshot(str(path))
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    artifacts = os.environ.get("TANDEM_ARTIFACTS_DIR")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(artifacts) / path.name)
    return path


async def test_cluster_page_follows_the_cluster(browser: object, stack: LocalStack, client: openai.AsyncOpenAI,
                                                stack_bus: Bus, tmp_path: Path) -> None:
    driver: Any = browser
    driver.get(f"{stack.metrics_url}/")  # redirects to the page
    assert driver.current_url.endswith("/cluster/page")
    expected = {"prefill-1": ("prefill", "active"), "decode-1": ("decode", "active"), "worker-1": ("both", "active")}
    await wait_for(lambda: shown_workers(driver) == expected, PAGE_WAIT_S, "every worker shown with its role")
    sections = driver.execute_script("return Array.from(document.querySelectorAll('.role')).map(r => r.dataset.role)")
    assert sections == ["prefill", "decode", "both"]

    # Routing decisions: requests through the router appear with the worker that served them.
    model = Tokenizer.from_model_dir(stack.config.model_dir).model_name
    for index in range(6):
        await client.completions.create(model=model, prompt=f"The river runs {index} " * (1 + index * 8),
                                        max_tokens=8)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    await wait_for(lambda: driver.execute_script("return document.querySelectorAll('table.requests tbody tr').length")
                   >= 7, PAGE_WAIT_S, "the requests in the routing panel")
    await wait_for(lambda: "not_found" in _text(driver, "errors"), PAGE_WAIT_S,
                   "the refused request among the recent errors")

    # A message from the network is shown as text, never run as markup.
    failed = TransferRecord(worker_id="decode-1", request_id="cmpl-hostile", kind="pull", peer_worker_id="prefill-1",
                            outcome="failed", blocks=4, blocks_ok=1, bytes=0, duration_s=0.01, pulled_tokens=0,
                            recomputed_tokens=16, reason=HOSTILE)
    await stack_bus.client.publish(Subjects(stack.config.namespace).kv_transfers("decode-1"), encode(failed))
    await wait_for(lambda: HOSTILE in _text(driver, "errors"), PAGE_WAIT_S, "the transfer failure's message")
    assert driver.execute_script("return document.getElementById('injected')") is None

    # A worker joins ...
    stack.start_worker(WorkerSpec(worker_id="decode-2", role=WorkerRole.DECODE))
    await wait_for(lambda: shown_workers(driver).get("decode-2") == ("decode", "active"), PAGE_WAIT_S,
                   "the new worker on the page")
    # ... and one is killed: shown as gone once its heartbeat expires (TTL 1.5 s here).
    stack.worker("worker-1").kill()
    await wait_for(lambda: shown_workers(driver).get("worker-1") == ("both", "gone"), PAGE_WAIT_S,
                   "the killed worker shown as gone")
    assert {worker_id for worker_id, (_, state) in shown_workers(driver).items() if state != "gone"} == {
        "prefill-1", "decode-1", "decode-2"}
    await wait_for(lambda: "heartbeat_lost" in _text(driver, "errors"), PAGE_WAIT_S, "the lost worker among errors")
    assert driver.find_element("id", "connection").get_attribute("data-state") == "live"

    for index in range(4):  # some traffic in the window for the screenshot
        last = await client.completions.create(model=model, prompt="A quiet harbour " * (40 + index), max_tokens=8)
    await wait_for(lambda: last.id in _text(driver, "routing"), PAGE_WAIT_S, "the latest request on the page")
    assert _card(driver, "requests/s") != "0" and _card(driver, "workers") == "3"
    shot = save_screenshot(driver, tmp_path / "cluster-page.png")
    assert shot.stat().st_size > 10_000
    assert console_errors(driver) == []


def _text(driver, element_id: str) -> str:  # type: ignore[no-untyped-def]
    return driver.execute_script("return document.getElementById(arguments[0]).textContent", element_id)


def _card(driver, label: str) -> str:  # type: ignore[no-untyped-def]
    cards = driver.execute_script("""return Array.from(document.querySelectorAll('.card'))
        .map(card => [card.querySelector('.label').textContent, card.querySelector('.value').textContent]);""")
    return dict(cards)[label]
