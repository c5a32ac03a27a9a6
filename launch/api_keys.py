"""API keys of a `tandem up` stack: the router is guarded by default.

Without a key file of the user's (`tandem up --api-keys-file`, or TANDEM_API_KEYS_FILE),
`stack_keys(state_dir)` makes one in the state directory, `api-keys.jsonl` (0600, hashes
only), with one key named `local`, whose plaintext goes only to `api-key` next to it
(0600): people and tests read the key from there; the status table shows that path, never
the key. A later `tandem up` with the same state directory keeps the same key while the
two files still match, and keeps any other key added to the file (`tandem keys create`).

The router gets the file's path as `--api-keys-file`: the key itself is never on a
command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from launch.definition import DefinitionError
from launch.plan import StackConfig
from shared.api_keys import ApiKey, KeyFileError, KeyTable, hash_key
from shared.api_keys_file import new_key, read_key_file, write_key_file, write_secret_file

KEYS_FILE, KEY_FILE, LOCAL_KEY = "api-keys.jsonl", "api-key", "local"


@dataclass(frozen=True, slots=True)
class StackKeys:
    keys_file: Path  # what the router reads
    key_file: Path | None = None  # the `local` key's plaintext, when tandem up made it


def stack_keys(state_dir: Path, given: str = "") -> StackKeys:
    """The key file the stack's router uses: `given` (a `DefinitionError` if unusable), else
    the state directory's own, made (or completed with a `local` key) when needed."""
    if given:
        try:
            read_key_file(given)  # checked now: a bad file stops `tandem up` before anything starts
        except KeyFileError as error:
            raise DefinitionError(str(error)) from None
        return StackKeys(Path(given).resolve())
    keys_file, key_file = (state_dir / KEYS_FILE).resolve(), (state_dir / KEY_FILE).resolve()
    try:
        table = read_key_file(keys_file) if keys_file.exists() else KeyTable()
    except KeyFileError:
        table = KeyTable()  # tandem up's own file, unusable: made again
    local = table.get(LOCAL_KEY)
    if local is not None and key_file.exists() and hash_key(key_file.read_text().strip()) == local.sha256:
        return StackKeys(keys_file, key_file)
    key = new_key()
    write_key_file(keys_file, table.with_key(ApiKey(name=LOCAL_KEY, sha256=hash_key(key))))
    write_secret_file(key_file, key + "\n")
    return StackKeys(keys_file, key_file)


def guarded(config: StackConfig, keys: StackKeys) -> StackConfig:
    """`config` whose router reads `keys.keys_file`."""
    return msgspec.structs.replace(config, router_args=(*config.router_args, "--api-keys-file", str(keys.keys_file)))


def with_stack_keys(config: StackConfig, state_dir: Path, given: str = "") -> tuple[StackConfig, StackKeys]:
    """`config` with its router guarded: by `given`, else the definition's router setting
    `api_keys_file`, else the state directory's own key file."""
    keys = stack_keys(state_dir, given or str(config.router_settings.get("api_keys_file", "")))
    return guarded(config, keys), keys
