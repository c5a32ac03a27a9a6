"""`tandem keys create|list|revoke`: the API key file the router (`--api-keys-file`) and the
metrics collector read (`shared.api_keys`).

`create` prints the new key once, on stdout, and stores only its SHA-256; `list` shows
names and limits, never a secret; `revoke` removes a key, which a running router refuses
from its next check of the file on (within about a second). The file is rewritten
atomically, mode 0600.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(help="API keys of the router and the metrics collector.", no_args_is_help=True)

KeyFile = Annotated[Path, typer.Option("--file", envvar="TANDEM_API_KEYS_FILE", help="The API key file.")]


def _load(path: Path, *, missing_ok: bool = False):
    from shared.api_keys import KeyFileError, KeyTable
    from shared.api_keys_file import read_key_file

    if missing_ok and not path.exists():
        return KeyTable()
    try:
        return read_key_file(path)
    except KeyFileError as error:
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(1) from None


@app.command()
def create(
    file: KeyFile,
    name: Annotated[str, typer.Option(help="The key's name: shown in logs, traces and metrics.")],
    rps: Annotated[Optional[float], typer.Option(help="Requests per second allowed (token bucket).")] = None,
    burst: Annotated[Optional[int], typer.Option(help="Requests allowed at once above the rate (bucket size).")] = None,
    max_concurrent: Annotated[Optional[int], typer.Option(help="Requests in flight at once.")] = None,
    tpm: Annotated[Optional[int], typer.Option(help="Tokens (prompt and completion) per minute.")] = None,
    priority: Annotated[Optional[int], typer.Option(
        help="Default priority of its requests (lower is more urgent; 0 when unset).")] = None,
    top_priority: Annotated[Optional[int], typer.Option(
        help="The most urgent priority its requests may ask for (a lower number is raised to it).")] = None,
    weight: Annotated[Optional[float], typer.Option(help="Its fair share in the admission queue (1 when unset).")] = None,
) -> None:
    """Make a key: printed once on stdout; the file keeps only its hash."""
    from shared.api_keys import ApiKey, hash_key, key_problems
    from shared.api_keys_file import new_key, write_key_file

    table = _load(file, missing_ok=True)
    if table.get(name) is not None:
        typer.secho(f"error: {file} already has a key named {name!r} (revoke it first)", fg="red", err=True)
        raise typer.Exit(1)
    key = new_key()
    entry = ApiKey(name=name, sha256=hash_key(key), rps=rps, burst=burst, max_concurrent=max_concurrent, tpm=tpm,
                   priority=priority, top_priority=top_priority, weight=weight)
    problems = key_problems(entry)
    if problems:
        raise typer.BadParameter("; ".join(problems))
    write_key_file(file, table.with_key(entry))
    typer.echo(f"created key {name!r} in {file} ({entry.limits_text()}); it is shown only now:", err=True)
    typer.echo(key)


@app.command("list")
def list_keys(file: KeyFile) -> None:
    """Names and limits of the keys in the file (no secrets)."""
    table = _load(file)
    if not len(table):
        typer.echo(f"no keys in {file}", err=True)
    for key in table.keys:
        typer.echo(f"{key.name}\t{key.limits_text()}")


@app.command()
def revoke(file: KeyFile, name: Annotated[str, typer.Option(help="The key's name.")]) -> None:
    """Remove a key; running services refuse it within about a second, without a restart."""
    from shared.api_keys_file import write_key_file

    table = _load(file)
    if table.get(name) is None:
        typer.secho(f"error: no key named {name!r} in {file}", fg="red", err=True)
        raise typer.Exit(1)
    write_key_file(file, table.without(name))
    typer.echo(f"revoked key {name!r}", err=True)
