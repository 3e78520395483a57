"""What the daskpipe pages cost the service: ``daskpipe bench dashboard``.

The throughput part of ``daskpipe bench runtime`` (its trivial two-stage model and plan, requests
sent with ``Service.map`` in chunks), run alternately with no page open and with all four daskpipe
pages open in headless Chromium, on one ``LocalCluster`` with a dashboard (workers as processes, as
``daskpipe bench runtime`` runs them by default). One Chromium stays up
throughout and only the four tabs are opened or closed; rounds alternate in ABBA order so that
drift (warm-up, other load on the machine) hits both sides alike, and the two rounds of a side in
a row share one opening (one set of pages open, never two); the figures are medians. After
the tabs are opened, an ``open`` round waits until Chromium has loaded them (its CPU use falls
below :data:`QUIET_CPU_PER_S`), so it times pages that are open, not pages being opened; what
opening cost is reported apart (``opening_pages``).

The recorder's hooks are always on (they are part of the plugin); what the pages add is their
periodic ``update`` on the scheduler's event loop and the Bokeh patches they push.
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import click
import psutil
import torch

from daskpipe.benchmarks.runtime_overhead import BATCH, profile_and_plan, trivial_model
from daskpipe.dashboard.server import PAGES

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
MODEL = "trivial-b32"
ROUND_REQUESTS = 30000
"""Requests per round: 1.5 to 3 s on the 2-core development machine, so that every round holds page
updates (one a second); rounds of 10000 lasted about 0.5 s and held one update or none."""
SETTLE_S = 2.0
"""Pause after opening or closing the pages (and after the previous round's futures are
released) before a round is timed."""
QUIET_CPU_PER_S = 0.4
"""After opening the pages, Chromium counts as done loading them (parsing BokehJS, building and
first drawing four documents: several CPU-seconds) once it uses less than this many CPU-seconds
per second; the timed round measures pages that are open, not pages being opened."""
QUIET_LIMIT_S = 30.0


def wait_until_chromium_quiet() -> tuple[float, float]:
    """Wait (at most :data:`QUIET_LIMIT_S`) until Chromium uses less than :data:`QUIET_CPU_PER_S`;
    the seconds waited and Chromium's CPU-seconds meanwhile (no Chromium: returns at once)."""
    start, cpu = time.perf_counter(), chromium_cpu_s()
    while time.perf_counter() - start < QUIET_LIMIT_S:
        before = chromium_cpu_s()
        time.sleep(1.0)
        if chromium_cpu_s() - before < QUIET_CPU_PER_S:
            break
    return time.perf_counter() - start, chromium_cpu_s() - cpu


class Pages:
    """A headless Chromium that stays up for the whole run, and opens or closes the daskpipe pages
    (one tab each, updating live): only the pages differ between the two sides."""

    def __init__(self, browser, base_url: str) -> None:
        self.browser, self.base_url, self.tabs = browser, base_url, []

    @property
    def opened(self) -> bool:
        return bool(self.tabs)

    def open(self) -> None:
        for url, _ in PAGES:
            tab = self.browser.new_page()
            tab.goto(f"{self.base_url}/{url}")
            tab.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0")
            self.tabs.append(tab)

    def close(self) -> None:
        while self.tabs:
            self.tabs.pop().close()


def _follow_page(url: str, opened) -> None:
    """In a thread of its own loop: open ``url`` as a Bokeh client session and receive its updates
    until the process ends (each connection reads its own messages only while its loop runs)."""
    import asyncio

    from bokeh.client import pull_session

    asyncio.set_event_loop(asyncio.new_event_loop())
    session = pull_session(url=url)
    opened.release()
    session._loop_until_closed()  # ClientSession.loop_until_closed went private in Bokeh 3


def _follow_pages(base_url: str, ready) -> None:
    """In a child process: follow every page, each as a Bokeh client session on its own thread."""
    opened = threading.Semaphore(0)
    for url, _ in PAGES:
        threading.Thread(target=_follow_page, args=(f"{base_url}/{url}", opened), daemon=True).start()
    for _ in PAGES:
        opened.acquire()
    ready.set()
    threading.Event().wait()  # until terminated


class BokehClientPages:
    """The pages followed by Bokeh's Python client in another process: the scheduler runs the same
    updates and pushes the same patches as for a browser, but nothing is rendered, so the cost
    measured is the scheduler's alone (on a small machine a browser competes for the same cores)."""

    def __init__(self, base_url: str) -> None:
        self.base_url, self.process = base_url, None

    @property
    def opened(self) -> bool:
        return self.process is not None

    def open(self) -> None:
        from distributed.utils import get_mp_context  # as Dask starts its workers: spawn unless configured

        context = get_mp_context()
        ready = context.Event()
        self.process = context.Process(target=_follow_pages, args=(self.base_url, ready), daemon=True)
        self.process.start()
        if not ready.wait(60):
            raise RuntimeError("the Bokeh client could not open the pages")

    def close(self) -> None:
        if self.process is not None:
            if not self.process.is_alive():
                raise RuntimeError(
                    f"the Bokeh client stopped following the pages (exit code {self.process.exitcode}): the round did not have them open"
                )
            self.process.terminate()
            self.process.join()
            self.process = None


@contextmanager
def bokeh_client_pages(base_url: str) -> Iterator[BokehClientPages]:
    pages = BokehClientPages(base_url)
    try:
        yield pages
    finally:
        pages.close()


@contextmanager
def chromium_pages(base_url: str, chromium: str) -> Iterator[Pages]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        try:
            yield Pages(browser, base_url)
        finally:
            browser.close()


def chromium_cpu_s() -> float:
    """CPU seconds used so far by the running Chromium processes (browser, renderers, GPU process)."""
    total = 0.0
    for process in psutil.process_iter(["name", "cpu_times"]):
        if "chrom" in (process.info["name"] or "") and process.info["cpu_times"] is not None:
            total += process.info["cpu_times"].user + process.info["cpu_times"].system
    return total


def timed_round(svc, requests: int, chunk: int) -> dict[str, float]:
    """One round as ``daskpipe bench runtime`` sends it: requests/s, this process's CPU per request
    (the client's and the scheduler's, and the in-process workers' too: the cost the pages put on
    the scheduler shows here), and Chromium's CPU seconds meanwhile (what the browser takes from
    the machine)."""
    from distributed import wait

    x = torch.zeros(1, 16)
    cpu, browser, start = time.process_time(), chromium_cpu_s(), time.perf_counter()
    futures = []
    for offset in range(0, requests, chunk):
        futures.extend(svc.map(MODEL, [x] * min(chunk, requests - offset)))
    wait(futures)
    elapsed = time.perf_counter() - start
    cpu, browser = time.process_time() - cpu, chromium_cpu_s() - browser
    if any(f.status != "finished" for f in futures):
        raise RuntimeError("some requests did not finish; the figures would not compare like with like")
    del futures
    return {"requests_per_second": requests / elapsed, "python_cpu_us_per_request": cpu / requests * 1e6, "chromium_cpu_s": browser}


def run(
    requests: int = ROUND_REQUESTS,
    rounds: int = 6,
    chunk: int = 500,
    viewer: str = "chromium",
    chromium: str | None = None,
    processes: bool = True,
) -> dict:
    from distributed import Client, LocalCluster, wait

    import daskpipe
    from daskpipe.runtime.worker.environ import stage_worker_environ

    chromium = chromium or shutil.which("chromium") or shutil.which("chromium-browser")
    if viewer == "chromium" and chromium is None:
        raise click.UsageError("needs a Chromium binary (apt-get install chromium), or --chromium PATH, or --viewer bokeh-client")
    requests = -(-requests // BATCH) * BATCH
    sides: dict[str, list[dict[str, float]]] = {"closed": [], "open": []}
    opening: list[dict[str, float]] = []  # what opening the pages cost, each time (not timed)
    with (
        stage_worker_environ(),
        LocalCluster(n_workers=2, threads_per_worker=1, processes=processes, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster) as client,
    ):
        profiles, plan = profile_and_plan({MODEL: BATCH})
        svc = daskpipe.deploy(client, {MODEL: trivial_model()}, example_inputs={MODEL: torch.zeros(1, 16)}, plan=plan, profiles=profiles)
        try:
            wait(svc.map(MODEL, [torch.zeros(1, 16)] * 2 * BATCH))  # warm the path
            base_url = f"http://127.0.0.1:{cluster.scheduler.http_server.port}"
            with chromium_pages(base_url, chromium) if viewer == "chromium" else bokeh_client_pages(base_url) as pages:
                for round_index in range(rounds):
                    for side in ("closed", "open") if round_index % 2 == 0 else ("open", "closed"):  # ABBA: no side always goes first
                        # two rounds of a side in a row share one opening (or closing): never two sets of pages open
                        if side == "open" and not pages.opened:
                            cpu = chromium_cpu_s()
                            pages.open()
                            waited, quiet_cpu = wait_until_chromium_quiet()
                            opening.append(
                                {"chromium_cpu_s": chromium_cpu_s() - cpu, "settle_s": waited, "settle_chromium_cpu_s": quiet_cpu}
                            )
                        elif side == "closed" and pages.opened:
                            pages.close()
                        time.sleep(SETTLE_S)
                        gc.collect()
                        sides[side].append(timed_round(svc, requests, chunk))
        finally:
            svc.close()
    medians = {side: {key: statistics.median(r[key] for r in results) for key in results[0]} for side, results in sides.items()}
    return {
        "cluster": f"LocalCluster, 2 CPU workers, {'processes' if processes else 'in-process (threads)'}, protocol tcp, dashboard on; "
        f"{psutil.cpu_count()} CPUs",
        "viewer": viewer,
        "requests_per_round": requests,
        "rounds_per_side": rounds,
        "pages_closed": medians["closed"],
        "pages_open": medians["open"],
        "throughput_drop": 1 - medians["open"]["requests_per_second"] / medians["closed"]["requests_per_second"],
        "python_cpu_increase": medians["open"]["python_cpu_us_per_request"] / medians["closed"]["python_cpu_us_per_request"] - 1,
        "opening_pages": opening,
        "rounds": sides,
    }


@click.command("dashboard")
@click.option("--requests", default=ROUND_REQUESTS, show_default=True, help="Requests per round (a round should last a few page updates).")
@click.option("--rounds", default=6, show_default=True, help="Rounds per side (pages closed, pages open), in ABBA order.")
@click.option(
    "--viewer",
    type=click.Choice(["chromium", "bokeh-client"]),
    default="chromium",
    show_default=True,
    help="Who opens the pages: headless Chromium on this machine, or Bokeh's Python client (no rendering: the scheduler's cost alone).",
)
@click.option("--chromium", type=click.Path(exists=True, dir_okay=False), help="The Chromium binary (default: chromium on PATH).")
@click.option(
    "--processes/--in-process",
    default=True,
    show_default=True,
    help="Workers as processes (as daskpipe runs them), or threads of this process.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_dashboard(requests: int, rounds: int, viewer: str, chromium: str | None, processes: bool, json_path: str | None) -> None:
    """Runtime throughput with the daskpipe pages closed and open."""
    if requests < 1 or rounds < 1:
        raise click.BadParameter("--requests and --rounds must be >= 1")
    figures = run(requests, rounds, viewer=viewer, chromium=chromium, processes=processes)
    text = json.dumps(figures, indent=1)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    bench_dashboard()
