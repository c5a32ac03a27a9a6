"""API keys, pure parts: the key file's format and lookup, the token bucket and the
concurrency count (with the time given), the decision; then the watched file (a revoked
key refused after a reload), `tandem keys` and the key file `tandem up` makes."""

from __future__ import annotations

import base64
import stat
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from cli.main import app as cli_app
from launch.api_keys import guarded, stack_keys, with_stack_keys
from launch.definition import DefinitionError
from launch.plan import StackConfig
from services.router.http.auth.decision import INVALID, MISSING, Denial, Granted, authorize
from services.router.http.auth.limits import KeyLimiter, Outcome, TokenBucket, retry_after
from shared.api_keys import ApiKey, KeyFileError, KeyTable, hash_key, parse_key_file, presented_key, render_key_file
from shared.api_keys_file import KeyFileWatcher, new_key, read_key_file, write_key_file


def entry(name: str, key: str, **limits) -> ApiKey:
    return ApiKey(name=name, sha256=hash_key(key), **limits)


# --- format and lookup


def test_key_file_round_trip_keeps_names_limits_and_only_hashes() -> None:
    table = KeyTable((entry("alice", "secret-a", rps=2.0, burst=4), entry("bob", "secret-b", max_concurrent=3)))
    text = render_key_file(table)
    assert "secret-a" not in text and "secret-b" not in text
    parsed = parse_key_file(text)
    assert parsed.keys == table.keys
    assert parsed.get("alice").bucket_size == 4 and parsed.get("bob").rps is None


def test_lookup_finds_the_key_by_hash_and_nothing_else() -> None:
    table = KeyTable((entry("alice", "secret-a"), entry("bob", "secret-b")))
    assert table.lookup("secret-b").name == "bob"
    assert table.lookup("secret-a").name == "alice"
    assert table.lookup("secret-c") is None
    assert table.lookup(hash_key("secret-a")) is None  # the stored hash is not a key
    assert KeyTable().lookup("anything") is None


@pytest.mark.parametrize("line, problem", [
    ('{"name": "a b", "sha256": "' + "0" * 64 + '"}', "name"),
    ('{"name": "a", "sha256": "abc"}', "sha256"),
    ('{"name": "a", "sha256": "' + "0" * 64 + '", "rps": 0}', "rps"),
    ('{"name": "a", "sha256": "' + "0" * 64 + '", "burst": 3}', "burst"),
    ('{"name": "a", "sha256": "' + "0" * 64 + '", "max_concurrent": 0}', "max_concurrent"),
    ('{"name": "a", "sha256": "' + "0" * 64 + '", "key": "plaintext"}', "key"),
    ('{"name": "a"', "line 2"),
])
def test_a_bad_line_is_an_error_naming_it(line: str, problem: str) -> None:
    with pytest.raises(KeyFileError, match=problem):
        parse_key_file("# comment\n" + line + "\n")


def test_names_and_keys_are_unique() -> None:
    one = '{"name": "a", "sha256": "' + hash_key("k1") + '"}'
    with pytest.raises(KeyFileError, match="used twice"):
        parse_key_file(one + "\n" + one.replace(hash_key("k1"), hash_key("k2")))
    with pytest.raises(KeyFileError, match="same hash"):
        parse_key_file(one + "\n" + one.replace('"a"', '"b"'))


def test_presented_key_from_the_authorization_header() -> None:
    assert presented_key("Bearer tdm_x") == "tdm_x"
    assert presented_key("bearer   tdm_x ") == "tdm_x"
    assert presented_key(None) is None and presented_key("") is None and presented_key("Bearer ") is None
    basic = "Basic " + base64.b64encode(b"anyone:tdm_x").decode()
    assert presented_key(basic) is None  # the router takes Bearer only
    assert presented_key(basic, basic=True) == "tdm_x"
    assert presented_key("Basic !!!", basic=True) is None


def test_new_keys_are_long_random_and_prefixed() -> None:
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(key.startswith("tdm_") and len(key) >= 40 for key in keys)


# --- limits, with the time given


def test_token_bucket_allows_the_burst_then_the_rate() -> None:
    bucket = TokenBucket(rate=2.0, size=3, now=100.0)
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(100.0) == pytest.approx(0.5)  # one token comes back in 1/rate seconds
    assert bucket.take(100.25) == pytest.approx(0.25)
    assert bucket.take(100.5) == 0.0
    assert bucket.take(110.0) == 0.0  # refilled, never past the size
    assert bucket.tokens == pytest.approx(2.0)
    assert bucket.take(90.0) == 0.0  # a clock running back refills nothing


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert retry_after(0.01) == 1 and retry_after(1.0) == 1 and retry_after(1.2) == 2 and retry_after(4.5) == 5


def test_rate_limited_key_gets_a_retry_after_from_its_bucket() -> None:
    limiter = KeyLimiter()
    slow = entry("slow", "k", rps=0.25, burst=1)
    assert limiter.admit(slow, 0.0).accepted
    limiter.release("slow")
    refused = limiter.admit(slow, 0.5)
    assert refused.outcome is Outcome.RATE_LIMITED and refused.retry_after_s == 4  # 3.5 s rounded up
    assert limiter.admit(slow, 4.0).accepted


def test_concurrency_is_counted_until_release_and_spends_no_token() -> None:
    limiter = KeyLimiter()
    key = entry("pair", "k", rps=10.0, burst=2, max_concurrent=2)
    assert limiter.admit(key, 0.0).accepted and limiter.admit(key, 0.0).accepted
    refused = limiter.admit(key, 0.0)
    assert refused.outcome is Outcome.CONCURRENCY_LIMITED and refused.retry_after_s == 1
    limiter.release("pair")
    assert limiter.in_flight == {"pair": 1}
    assert limiter.admit(key, 0.1).accepted  # the refusal above took no token: one was left at 0.1 s
    limiter.release("pair")
    limiter.release("pair")
    assert limiter.in_flight == {}


def test_keys_have_limits_of_their_own_and_a_changed_limit_gets_a_fresh_bucket() -> None:
    limiter = KeyLimiter()
    a, b = entry("a", "ka", rps=1.0, burst=1), entry("b", "kb", rps=1.0, burst=1)
    assert limiter.admit(a, 0.0).accepted and limiter.admit(b, 0.0).accepted
    assert not limiter.admit(a, 0.0).accepted
    assert limiter.admit(entry("a", "ka", rps=1.0, burst=5), 0.0).accepted  # file edited: new limits


def test_authorize_answers_what_the_client_needs() -> None:
    table = KeyTable((entry("alice", "ka", rps=1.0, burst=1), entry("open", "ko")))
    limiter = KeyLimiter()
    missing = authorize(table, limiter, None, 0.0)
    assert isinstance(missing, Denial) and missing.status == 401 and missing.code == MISSING
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")
    wrong = authorize(table, limiter, "Bearer nope", 0.0)
    assert isinstance(wrong, Denial) and wrong.status == 401 and wrong.code == INVALID and "nope" not in wrong.message
    granted = authorize(table, limiter, "Bearer ka", 0.0)
    assert isinstance(granted, Granted) and granted.key.name == "alice"
    limited = authorize(table, limiter, "Bearer ka", 0.2)
    assert isinstance(limited, Denial) and limited.status == 429 and limited.headers == {"Retry-After": "1"}
    assert limited.key_name == "alice" and "ka" not in limited.message.replace("alice", "")
    for _ in range(100):
        assert isinstance(authorize(table, limiter, "Bearer ko", 0.0), Granted)  # no limits: unlimited


# --- the file on disk


def test_written_key_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "keys.jsonl"
    write_key_file(path, KeyTable((entry("a", "k"),)))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_key_file(path).names == ["a"]
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left


def test_watcher_reloads_a_changed_file_at_most_once_per_interval(tmp_path: Path) -> None:
    path = tmp_path / "keys.jsonl"
    write_key_file(path, KeyTable((entry("alice", "ka"), entry("bob", "kb"))))
    watcher = KeyFileWatcher(path, check_interval_s=1.0)
    assert watcher.table(10.0).lookup("kb").name == "bob"
    write_key_file(path, KeyTable((entry("alice", "ka"),)))  # bob revoked
    assert watcher.table(10.5).lookup("kb") is not None  # not checked again yet
    assert watcher.table(11.0).lookup("kb") is None
    assert watcher.table(11.0).lookup("ka").name == "alice"


def test_watcher_keeps_the_last_good_keys_for_a_broken_file_and_drops_all_for_a_missing_one(tmp_path: Path) -> None:
    path = tmp_path / "keys.jsonl"
    write_key_file(path, KeyTable((entry("alice", "ka"),)))
    watcher = KeyFileWatcher(path)
    watcher.table(0.0)
    path.write_text("{not json\n")
    assert watcher.table(5.0).names == ["alice"]
    path.unlink()
    assert watcher.table(10.0).names == []
    write_key_file(path, KeyTable((entry("carol", "kc"),)))
    assert watcher.table(15.0).names == ["carol"]


def test_watcher_refuses_a_bad_file_at_start(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot read"):
        KeyFileWatcher(tmp_path / "absent.jsonl")


# --- tandem keys


def test_tandem_keys_create_list_revoke(tmp_path: Path) -> None:
    path = tmp_path / "keys.jsonl"
    runner = CliRunner()
    created = runner.invoke(cli_app, ["keys", "create", "--file", str(path), "--name", "alice",
                                      "--rps", "2", "--burst", "5", "--max-concurrent", "3"])
    assert created.exit_code == 0, created.output
    key = created.stdout.strip().splitlines()[-1]
    assert key.startswith("tdm_")
    assert key not in path.read_text() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_key_file(path).lookup(key).name == "alice"
    again = runner.invoke(cli_app, ["keys", "create", "--file", str(path), "--name", "alice"])
    assert again.exit_code == 1
    assert runner.invoke(cli_app, ["keys", "create", "--file", str(path), "--name", "bob"]).exit_code == 0
    listed = runner.invoke(cli_app, ["keys", "list", "--file", str(path)])
    assert listed.exit_code == 0 and "alice\t2 req/s, burst 5, 3 concurrent" in listed.stdout
    assert "bob\tunlimited" in listed.stdout and key not in listed.output and "sha256" not in listed.output
    assert runner.invoke(cli_app, ["keys", "revoke", "--file", str(path), "--name", "alice"]).exit_code == 0
    assert read_key_file(path).names == ["bob"]
    assert runner.invoke(cli_app, ["keys", "revoke", "--file", str(path), "--name", "alice"]).exit_code == 1


def test_tandem_keys_create_takes_a_token_budget_and_the_admission_queue_s_fields(tmp_path: Path) -> None:
    path = tmp_path / "keys.jsonl"
    runner = CliRunner()
    created = runner.invoke(cli_app, ["keys", "create", "--file", str(path), "--name", "batch", "--tpm", "6000",
                                      "--priority", "5", "--top-priority", "0", "--weight", "0.5"])
    assert created.exit_code == 0, created.output
    key = read_key_file(path).get("batch")
    assert (key.tpm, key.priority, key.top_priority, key.weight) == (6000, 5, 0, 0.5)
    listed = runner.invoke(cli_app, ["keys", "list", "--file", str(path)])
    assert "batch\t6000 tokens/min; priority 5, top priority 0, weight 0.5" in listed.stdout
    refused = runner.invoke(cli_app, ["keys", "create", "--file", str(path), "--name", "bad", "--priority", "-3",
                                      "--top-priority", "0"])
    assert refused.exit_code != 0 and "top_priority" in refused.output


def test_a_key_file_refuses_impossible_budgets_weights_and_priorities() -> None:
    for fields, problem in (({"tpm": 0}, "tpm"), ({"weight": 0.0}, "weight"),
                            ({"priority": -1, "top_priority": 0}, "top_priority")):
        line = msgspec.json.encode(entry("k", "secret", **fields)).decode()
        with pytest.raises(KeyFileError, match=problem):
            parse_key_file(line)


# --- the key file tandem up makes


def test_stack_keys_made_once_then_kept(tmp_path: Path) -> None:
    first = stack_keys(tmp_path)
    key = first.key_file.read_text().strip()
    for path in (first.keys_file, first.key_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert key not in first.keys_file.read_text()
    assert read_key_file(first.keys_file).lookup(key).name == "local"
    assert stack_keys(tmp_path).key_file.read_text().strip() == key  # same state directory: same key
    first.key_file.write_text("lost\n")
    remade = stack_keys(tmp_path).key_file.read_text().strip()
    assert remade != key and read_key_file(first.keys_file).lookup(remade).name == "local"
    assert read_key_file(first.keys_file).lookup(key) is None


def test_stack_keys_given_file_is_used_as_it_is(tmp_path: Path) -> None:
    given = tmp_path / "mine.jsonl"
    with pytest.raises(DefinitionError, match="cannot read"):
        stack_keys(tmp_path / "state", str(given))
    write_key_file(given, KeyTable((entry("theirs", "k"),)))
    keys = stack_keys(tmp_path / "state", str(given))
    assert keys.keys_file == given.resolve() and keys.key_file is None
    assert not (tmp_path / "state").exists()
    config = guarded(StackConfig(model_dir="m", router_args=("--routing-policy", "random")), keys)
    assert config.router_args == ("--routing-policy", "random", "--api-keys-file", str(given.resolve()))


def test_a_definition_naming_a_key_file_is_used_as_given(tmp_path: Path) -> None:
    write_key_file(tmp_path / "theirs.jsonl", KeyTable((entry("theirs", "k"),)))
    config = StackConfig(model_dir="m", router_settings={"api_keys_file": str(tmp_path / "theirs.jsonl")})
    guarded_config, keys = with_stack_keys(config, tmp_path / "state")
    assert keys.keys_file == (tmp_path / "theirs.jsonl").resolve() and keys.key_file is None
    assert guarded_config.router_args[-1] == str(keys.keys_file)
    _, made = with_stack_keys(StackConfig(model_dir="m"), tmp_path / "state")
    assert made.key_file == (tmp_path / "state" / "api-key").resolve()
