"""`tandem status`: the cluster as a table in the terminal, read from the metrics
collector's `/cluster` JSON (`services.metrics.cluster_view.ClusterStatus`).

One row per worker, grouped by role: status, load (running / waiting), KV blocks used /
total, leases, request and transfer rates, engine, shape (how its KV is cut: tensor- and
pipeline-parallel degree, tokens per block), model, compatibility hash and restarts
(with how the previous process ended); workers
gone lately and the latest errors below. `--json` prints the collector's answer as it is
(for machines); `--watch` redraws every `--interval` seconds until Ctrl-C. A collector that
cannot be reached, answers an error or answers something else than the cluster JSON is a
clear message on stderr and exit code 1.
"""

from __future__ import annotations

import time
from typing import Annotated

import httpx
import msgspec
import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from services.metrics.cluster_view import ClusterStatus

DEFAULT_METRICS_URL = "http://127.0.0.1:9100"  # the local stack's collector (launch/stacks/local.toml)
_decoder = msgspec.json.Decoder(ClusterStatus)

app = typer.Typer()


class StatusError(Exception):
    """The collector's cluster view could not be read; the message says why, for people."""


def fetch_status(metrics_url: str, timeout_s: float = 5.0, api_key: str = "") -> tuple[bytes, ClusterStatus]:
    url = metrics_url.rstrip("/") + "/cluster"
    try:
        response = httpx.get(url, timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
    except httpx.HTTPError as error:
        raise StatusError(f"cannot reach the metrics collector at {url} ({error or type(error).__name__}); "
                          "is the stack running? (`tandem up`, or pass --metrics-url)") from error
    if response.status_code == 401:
        raise StatusError(f"the metrics collector at {url} needs an API key (--api-key-file)")
    if response.status_code != 200:
        raise StatusError(f"the metrics collector at {url} answered HTTP {response.status_code}")
    try:
        return response.content, _decoder.decode(response.content)
    except msgspec.DecodeError as error:
        raise StatusError(f"{url} did not answer Tandem's cluster view: {error}") from error


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.0f}%"


def status_view(status: ClusterStatus) -> Group:
    """The whole terminal view of one `/cluster` answer."""
    totals, activity = status.totals, status.activity
    summary = Text(f"{totals.workers} workers · running {totals.running} · waiting {totals.waiting} · "
                   f"KV {_percent(totals.kv_usage)} · {activity.requests_per_s:.1f} req/s · "
                   f"{activity.transfers_per_s:.1f} transfers/s (last {activity.window_s:.0f} s)")
    parts: list[Table | Text] = [workers_table(status), summary]
    if activity.departed:
        gone = Table(title="gone lately", title_justify="left")
        for column in ("worker", "role", "left", "why"):
            gone.add_column(column)
        for departed in activity.departed:
            gone.add_row(departed.worker_id, departed.role, f"{status.now - departed.left_at:.0f} s ago",
                         departed.reason)
        parts.append(gone)
    if activity.recent_errors:
        errors = Table(title="recent errors", title_justify="left")
        for column in ("when", "kind", "code", "worker", "request", "detail"):
            errors.add_column(column, overflow="fold")
        for error in activity.recent_errors[:5]:
            errors.add_row(f"{status.now - error.at:.0f} s ago", error.kind, error.code, error.worker_id or "-",
                           error.request_id or "-", error.message)
        parts.append(errors)
    return Group(*parts)


def workers_table(status: ClusterStatus) -> Table:
    table = Table(title="Tandem cluster", title_justify="left")
    table.add_column("worker", no_wrap=True)
    table.add_column("role")
    table.add_column("status")
    table.add_column("running", justify="right")
    table.add_column("waiting", justify="right")
    table.add_column("KV used/total", justify="right")
    table.add_column("leases", justify="right")
    table.add_column("req/s", justify="right")
    table.add_column("engine")
    table.add_column("shape", no_wrap=True)
    table.add_column("model")
    table.add_column("compat", no_wrap=True)
    table.add_column("restarts", overflow="fold")
    by_id = {worker.worker_id: worker for worker in status.workers}
    for group in status.roles:
        for worker_id in group.worker_ids:
            worker = by_id[worker_id]
            rates = status.activity.workers.get(worker_id)
            table.add_row(
                worker.worker_id, worker.role,
                Text(worker.status, style="green" if worker.status == "active" else "yellow"),
                str(worker.running), str(worker.waiting),
                f"{worker.kv_used_blocks}/{worker.kv_total_blocks} ({_percent(worker.kv_usage)})",
                str(worker.active_leases), f"{rates.requests_per_s if rates else 0.0:.1f}",
                worker.engine, worker.shape or "-", worker.model, worker.compat_hash[:12], _restarts(worker.restarts, worker.last_exit))
        table.add_section()
    return table


def _read_key(path: str) -> str:
    try:
        return open(path).read().strip() if path else ""
    except OSError as error:
        raise StatusError(f"cannot read the API key file {path}: {error.strerror}") from None


@app.command()
def status(
    metrics_url: Annotated[str, typer.Option(envvar="TANDEM_METRICS_URL",
                                             help="The metrics collector's base URL.")] = DEFAULT_METRICS_URL,
    as_json: Annotated[bool, typer.Option("--json", help="Print the collector's /cluster JSON as it is.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Redraw until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between redraws with --watch.")] = 2.0,
    api_key_file: Annotated[str, typer.Option(envvar="TANDEM_API_KEY_FILE",
                                              help="A file holding a key, for a collector behind API keys.")] = "",
) -> None:
    """The cluster as a table: workers, roles, load, KV, leases, engines, shapes and versions."""
    console, errors = Console(), Console(stderr=True)
    try:
        api_key = _read_key(api_key_file)
        body, cluster = fetch_status(metrics_url, api_key=api_key)
        if as_json:
            typer.echo(body.decode())
            return
        if not watch:
            console.print(status_view(cluster))
            return
        with Live(status_view(cluster), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(status_view(fetch_status(metrics_url, api_key=api_key)[1]), refresh=True)
    except StatusError as error:
        errors.print(f"[red]error:[/] {error}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass


def _restarts(restarts: int, last_exit: str) -> Text:
    """"0", or the count with how the previous process ended."""
    if not restarts:
        return Text("0")
    return Text(f"{restarts} (last: {last_exit})" if last_exit else str(restarts), style="yellow")
