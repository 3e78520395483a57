"""What the daskpipe pages cost the service: ``python -m daskpipe.dashboard.bench``.

The throughput part of ``daskpipe bench runtime`` (its trivial two-stage model and plan, requests
sent with ``Service.map`` in chunks), run alternately with no page open and with all four daskpipe
pages open in headless Chromium, on one ``LocalCluster`` with a dashboard. Rounds alternate so that
drift (warm-up, other load on the machine) hits both sides alike; the figures are medians.

The recorder's hooks are always on (they are part of the plugin); what the pages add is their
periodic ``update`` on the scheduler's event loop and the Bokeh patches they push.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import click
import torch

from daskpipe.dashboard.server import PAGES
from daskpipe.runtime.bench import BATCH, _profile_and_plan, _trivial_model

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"]
MODEL = "trivial-b32"


@contextmanager
def open_pages(base_url: str, chromium: str) -> Iterator[None]:
    """All daskpipe pages open (one tab each, updating live) in headless Chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        try:
            for url, _ in PAGES:
                page = browser.new_page()
                page.goto(f"{base_url}/{url}")
                page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0")
            yield
        finally:
            browser.close()


def requests_per_second(svc, requests: int, chunk: int) -> float:
    """Requests/s of ``requests`` sent in ``chunk``\\ s, as ``daskpipe bench runtime`` sends them."""
    from distributed import wait

    x = torch.zeros(1, 16)
    start = time.perf_counter()
    futures = []
    for offset in range(0, requests, chunk):
        futures.extend(svc.map(MODEL, [x] * min(chunk, requests - offset)))
    wait(futures)
    elapsed = time.perf_counter() - start
    if any(f.status != "finished" for f in futures):
        raise RuntimeError("some requests did not finish; the figures would not compare like with like")
    return requests / elapsed


def run(requests: int = 3000, rounds: int = 3, chunk: int = 500, chromium: str | None = None) -> dict:
    from distributed import Client, LocalCluster, wait

    import daskpipe

    chromium = chromium or shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise click.UsageError("needs a Chromium binary (apt-get install chromium), or --chromium PATH")
    requests = -(-requests // BATCH) * BATCH
    closed, opened = [], []
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        profiles, plan = _profile_and_plan({MODEL: BATCH})
        svc = daskpipe.deploy(client, {MODEL: _trivial_model()}, example_inputs={MODEL: torch.zeros(1, 16)}, plan=plan, profiles=profiles)
        try:
            wait(svc.map(MODEL, [torch.zeros(1, 16)] * 2 * BATCH))  # warm the path
            base_url = f"http://127.0.0.1:{cluster.scheduler.http_server.port}"
            for _ in range(rounds):
                closed.append(requests_per_second(svc, requests, chunk))
                with open_pages(base_url, chromium):
                    opened.append(requests_per_second(svc, requests, chunk))
        finally:
            svc.close()
    closed_rps, open_rps = statistics.median(closed), statistics.median(opened)
    return {
        "cluster": "LocalCluster, 2 CPU workers, in-process (threads), protocol tcp, dashboard on",
        "requests_per_round": requests,
        "rounds": rounds,
        "pages_closed_requests_per_second": closed_rps,
        "pages_open_requests_per_second": open_rps,
        "drop": 1 - open_rps / closed_rps,
        "rounds_closed": closed,
        "rounds_open": opened,
    }


@click.command("dashboard")
@click.option("--requests", default=3000, show_default=True, help="Requests per round.")
@click.option("--rounds", default=3, show_default=True, help="Rounds, each one with the pages closed then one with them open.")
@click.option("--chromium", type=click.Path(exists=True, dir_okay=False), help="The Chromium binary (default: chromium on PATH).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_dashboard(requests: int, rounds: int, chromium: str | None, json_path: str | None) -> None:
    """Runtime throughput with the daskpipe pages closed, then open in headless Chromium."""
    if requests < 1 or rounds < 1:
        raise click.BadParameter("--requests and --rounds must be >= 1")
    figures = run(requests, rounds, chromium=chromium)
    text = json.dumps(figures, indent=1)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    bench_dashboard()
