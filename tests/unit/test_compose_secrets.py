"""The compose stack's secrets (`launch.compose_secrets.ensure_secrets`) on real files: a NATS
user per worker slot and none shared, slot files beside them, a second run keeping everything,
more slots than before making the NATS files again, fewer keeping them."""

from __future__ import annotations

from pathlib import Path

from launch.compose_secrets import DEFAULT_WORKER_SLOTS, compose_users, control_users, ensure_secrets
from shared.nats_secrets import read_credentials
from shared.worker_slots import listed_slots

HOSTS = ("nats", "localhost")


def password(nats_dir: Path, user: str) -> str:
    return read_credentials(nats_dir / "creds" / f"{user}.creds").password


def test_a_user_per_slot_and_no_shared_worker_user(tmp_path: Path) -> None:
    made = ensure_secrets(tmp_path / "secrets", "tandem", HOSTS, slots_dir=tmp_path / "slots")
    assert made.made_nats and len(made.worker_slots) == DEFAULT_WORKER_SLOTS == 8
    users = sorted(path.stem for path in (made.nats_dir / "creds").glob("*.creds"))
    assert users == sorted(compose_users(made.worker_slots))
    assert "worker" not in users and "worker-w08" in users
    assert listed_slots(tmp_path / "slots") == made.worker_slots
    for user in ("worker-w01", "router"):
        assert (made.nats_dir / "tls" / f"client-{user}-cert.pem").is_file()


def test_a_second_run_keeps_the_secrets_more_slots_make_them_again_fewer_keep_them(tmp_path: Path) -> None:
    secrets, slots = tmp_path / "secrets", tmp_path / "slots"
    first = ensure_secrets(secrets, "tandem", HOSTS, worker_slots=2, slots_dir=slots)
    before = password(first.nats_dir, "worker-w02")
    again = ensure_secrets(secrets, "tandem", HOSTS, worker_slots=2, slots_dir=slots)
    assert not again.made_nats and password(again.nats_dir, "worker-w02") == before
    grown = ensure_secrets(secrets, "tandem", HOSTS, worker_slots=3, slots_dir=slots)
    assert grown.made_nats and password(grown.nats_dir, "worker-w02") != before  # one consistent set
    assert listed_slots(slots) == ("w01", "w02", "w03")
    shrunk = ensure_secrets(secrets, "tandem", HOSTS, worker_slots=1, slots_dir=slots)
    assert not shrunk.made_nats and listed_slots(slots) == ("w01",)
    assert set(control_users()) <= {path.stem for path in (shrunk.nats_dir / "creds").glob("*.creds")}
