"""daskpipe's dashboard against a running service: views, pages in a real browser, /metrics, report.

One module-scoped cluster (an emulated L4 and T4 on two servers, in this process, with a
dashboard) serves the runtime tests' two-stage model; every test reads what its requests left.
"""

from __future__ import annotations

import os
import shutil
import threading
import urllib.request
from pathlib import Path

import pytest
from distributed import Client, LocalCluster, wait

import daskpipe
from daskpipe.dashboard.components import VIEWS, BatchView, GPUView, PlanView, SLOView
from daskpipe.dashboard.report import save_report
from daskpipe.dashboard.server import PAGES, live_reader
from daskpipe.runtime.scheduler.plugin import DaskpipeSchedulerPlugin, plugin_of
from daskpipe.sched.metrics import BUCKET_S
from tests.runtime.helpers import example, tiny_model, two_stage

pytestmark = pytest.mark.timeout(60)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def serving():
    """The cluster, its client and the service, after 48 requests have ended."""
    from daskpipe.runtime.cluster import EmulatedCluster

    profile, plan = two_stage()
    with (
        EmulatedCluster({"L4": 1, "T4": 1}, servers=2, processes=False, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster) as client,
    ):
        svc = daskpipe.deploy(client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=plan, profiles={"tiny": profile})
        try:
            wait(svc.map("tiny", [example() for _ in range(48)]), timeout=30)
            yield cluster, client, svc
        finally:
            svc.close()


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def feed(svc, stop: threading.Event) -> None:
    """Keep the service busy while the pages are open: 6 requests every 50 ms, 120/s (not whole
    batches of 4, so some wait for the next message)."""
    futures = []
    while not stop.wait(0.05):
        futures += svc.map("tiny", [example() for _ in range(6)])
    wait(futures, timeout=30)


def base_url(cluster) -> str:
    return f"http://127.0.0.1:{cluster.scheduler.http_server.port}"


def test_each_view_holds_data_from_the_service(serving):
    cluster, _, _ = serving
    live = live_reader(cluster.scheduler)

    def read():  # a second ahead: the series show completed seconds, the 48 requests may be in this one
        metrics, now = live()
        return metrics, now + BUCKET_S

    plan = PlanView(read)
    plan.update()
    assert plan.source.data["gpu"] == ["L4", "T4"]
    assert plan.source.data["table"] == ["not recorded"] * 2, "a hand-made plan says where its tables came from: nowhere"
    assert list(plan.figure.y_range.factors) and plan.flow.data["x1"] == [1]
    assert "not proven (no bound)" in plan.quality.text, "a hand-made plan has no bound: the page says it is not proven"
    slos = SLOView(read)
    slos.update()
    assert sum(slos.rates.column("tiny offered")) == 48 and sum(slos.rates.column("tiny goodput")) == 48
    assert set(slos.latency.column("tiny SLO")) == {500.0}
    assert any(y == y for y in slos.latency.column("tiny p50"))  # some second has a p50 (not NaN)
    breakdown = slos.breakdown_source.data
    assert breakdown["model"] == ["tiny"] and breakdown["compute"][0] > 0 and breakdown["queue"][0] >= 0
    gpus = GPUView(read)
    gpus.update()
    kinds = set(gpus.timeline_source.data["kind"])
    assert kinds == {"planned", "busy"}
    assert gpus.utilisation_source.data["gpu"] == ["L4", "T4"] and max(gpus.utilisation_source.data["utilisation"]) > 0
    assert gpus.nic_source.data["link"]  # the stages sit on two servers: the feature map crosses a NIC
    batches = BatchView(read)
    batches.update()
    assert sum(batches.histogram_source.data["batches"]) == plugin_of(cluster.scheduler).models.status()["tiny"]["batches"]
    assert batches.queue.labels == ["tiny (longest in each second)"] and len(batches.queue.column("tiny (longest in each second)")) > 0


def test_metrics_routes_expose_daskpipe_histograms_and_gauges(serving):
    cluster, _, _ = serving
    for path in ("/metrics", "/daskpipe/metrics"):
        text = http_get(base_url(cluster) + path)
        for name in (
            'dask_daskpipe_request_latency_seconds_bucket{le="+Inf",model="tiny"} 48.0',
            'dask_daskpipe_requests_total{model="tiny",outcome="on_time"} 48.0',
            'dask_daskpipe_queue_depth{model="tiny"} 0.0',
            'dask_daskpipe_slo_attainment{model="tiny"} 1.0',
            'dask_daskpipe_request_phase_seconds_count{model="tiny",phase="compute"} 48.0',
            "dask_daskpipe_gpu_utilization{gpu=",
            "dask_daskpipe_batches_total{",
        ):
            assert name in text, (path, name)


@pytest.mark.heavy
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_pages_in_headless_chromium_show_the_service(serving, tmp_path_factory):
    playwright = pytest.importorskip("playwright.sync_api")
    cluster, _, svc = serving
    shots = Path(os.environ.get("DASKPIPE_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots of the daskpipe pages: {shots}")
    sizes_js = """() => {
        const doc = window.Bokeh && Bokeh.documents[0];
        if (!doc) return null;
        return [...doc.all_models].filter(m => typeof m.get_length === "function").map(m => m.get_length() || 0);
    }"""
    column_js = """(name) => {  // the values of every column called name (or <chart>/name), in the page's sources
        const doc = Bokeh.documents[0];
        return [...doc.all_models].filter(m => typeof m.get_column === "function" && typeof m.columns === "function").flatMap(m =>
            m.columns().filter(key => key === name || key.endsWith("/" + name)).flatMap(key => [...m.get_column(key)]));
    }"""
    burst = svc.map("tiny", [example() for _ in range(1500)])  # far more than the SLO allows: drops for the table
    wait(burst, timeout=30)
    assert any(f.status == "error" for f in burst)
    stop = threading.Event()
    feeder = threading.Thread(target=feed, args=(svc, stop), daemon=True)
    feeder.start()
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(base_url(cluster) + "/status")
            assert page.locator('a[href="daskpipe-plan"]').count() == 1  # in Dask's navigation bar
            for url, _ in PAGES:
                page.goto(f"{base_url(cluster)}/{url}")
                page.wait_for_function(f"({sizes_js})() !== null")
                page.wait_for_timeout(1200)  # one periodic update, so the page shows the pushed data
                sizes = page.evaluate(sizes_js)
                assert sizes and max(sizes) > 0, (url, sizes)
                if url == "daskpipe-slos":
                    assert {"deadline", "overload"} & set(page.evaluate(column_js, "reason"))  # the recent drops table
                    assert max(page.evaluate(column_js, "compute")) > 0  # the latency breakdown
                    assert sum(page.evaluate(column_js, "tiny offered")) > 0  # the offered-rate series
                page.screenshot(path=str(shots / f"{url}.png"), full_page=True)
        finally:
            browser.close()
            stop.set()
            feeder.join()
    assert sorted(f.name for f in shots.glob("daskpipe-*.png")) == sorted(f"{url}.png" for url, _ in PAGES)


def test_report_is_one_html_file_with_every_page(serving, tmp_path):
    cluster, _, _ = serving
    path = save_report(plugin_of(cluster.scheduler).metrics, tmp_path / "report.html")
    html = path.read_text()
    assert all(title in html for title, _ in VIEWS.values())


def test_pages_appear_when_the_plugin_is_registered_after_the_scheduler_started():
    with LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        client.register_plugin(DaskpipeSchedulerPlugin())
        html = http_get(base_url(cluster) + "/daskpipe-plan")
        assert 'href="daskpipe-slos"' in html  # daskpipe's page, with its own links


def test_a_closed_page_is_destroyed_without_a_full_collection_of_the_schedulers_heap():
    import gc
    import weakref

    from bokeh.document import Document

    from daskpipe.dashboard.server import page_doc

    class Scheduler:
        plugins: dict = {}

    class Session:  # what Bokeh's server session registers on the document it serves
        def _document_patched(self, event) -> None:
            pass

    class Cycle:
        pass

    def garbage_cycle() -> weakref.ref:
        cycle = Cycle()
        cycle.itself = cycle
        return weakref.ref(cycle)

    for page, destroyed_with_full_collection in (("slos", False), (None, True)):  # a daskpipe page, a plain Bokeh document
        document, session = Document(), Session()
        if page is not None:
            page_doc(page)(Scheduler(), {}, document)
        document.on_change_dispatch_to(session)
        old_garbage = garbage_cycle()
        document.destroy(session)  # as Bokeh's session clean-up does, on the scheduler's event loop
        assert (old_garbage() is None) == destroyed_with_full_collection
        gc.collect()
        assert old_garbage() is None  # the collector's next full pass takes it
