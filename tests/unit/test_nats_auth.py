"""The NATS permission table and server configuration (pure), the URL redaction, and the
credentials file format."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shared.nats_auth import (
    AuthorizedUser,
    NatsUser,
    Role,
    ServerTls,
    has_userinfo,
    permissions,
    redact_url,
    render_server_config,
    shared_worker_user,
    stack_users,
    user_name,
)
from shared.nats_secrets import Credentials, CredentialsError, read_credentials, write_credentials
from shared.nats_server import find_binary
from shared.subjects import Subjects

S = Subjects("ns")


def perms(role: Role, worker_id: str = ""):
    return permissions(NatsUser(name=user_name(role, worker_id), role=role, worker_id=worker_id), S)


def test_a_worker_serves_only_its_own_subjects() -> None:
    p = perms(Role.WORKER, "w1")
    assert set(p.subscribe) == {"_INBOX.worker-w1.>", "ns.v1.worker.w1.generate", "ns.v1.ctl.w1.*",
                                "ns.v1.kv.lease.w1", "ns.v1.kv.release.w1"}
    assert "ns.v1.kv.lease.*" in p.publish and "ns.v1.ctl.*.push_done" in p.publish
    assert "$KV.ns_v1_members.w1" in p.publish and "$KV.ns_v1_members.>" not in p.publish
    assert not [s for s in p.publish if s.startswith("ns.v1.ctl.") and not s.endswith("push_done")]
    assert not [s for s in p.publish if "generate" in s]


def test_the_shared_worker_user_has_the_worker_permissions_for_any_worker_id() -> None:
    p = permissions(shared_worker_user(), S)
    assert set(p.subscribe) == {"_INBOX.worker.>", "ns.v1.worker.*.generate", "ns.v1.ctl.*.*",
                                "ns.v1.kv.lease.*", "ns.v1.kv.release.*"}
    assert {"ns.v1.kv.events.*", "ns.v1.load.*", "ns.v1.kv.transfers.*", "$KV.ns_v1_members.*"} <= set(p.publish)
    assert not [s for s in p.publish if "generate" in s or "drain" in s or s == "$KV.ns_v1_members.>"]
    assert [user.name for user in stack_users([], shared_worker=True)][-1] == "worker"
    assert "worker" not in [user.name for user in stack_users(["w1"])]


def test_the_router_neither_drains_nor_asks_for_leases() -> None:
    p = perms(Role.ROUTER)
    assert {"ns.v1.worker.*.generate", "ns.v1.ctl.*.cancel", "ns.v1.ctl.*.kv_snapshot",
            "ns.v1.kv.release.*"} <= set(p.publish)
    # of key-value subjects, only the responses bucket's (never a registration in the members bucket)
    assert not [s for s in p.publish if "drain" in s or "kv.lease" in s or s == "_INBOX.>"
                or (s.startswith("$KV.") and s != "$KV.ns_v1_responses.>")]
    assert p.subscribe[0] == "_INBOX.router.>"
    # it answers the requests it gets (the workers' probes of its streams), and it alone
    assert p.responses and not [user.name for user in stack_users(["w1"])
                                if user.name != "router" and permissions(user, S).responses]


def test_only_the_operator_and_the_orchestrator_drain_and_the_operator_cannot_create_the_bucket() -> None:
    drainers = [user.name for user in stack_users(["w1"]) if "ns.v1.ctl.*.drain" in permissions(user, S).publish]
    assert drainers == ["orchestrator", "operator"]
    commanders = [user.name for user in stack_users(["w1"])
                  if "ns.v1.orchestrator.commands" in permissions(user, S).publish]
    assert commanders == ["operator"]
    assert "ns.v1.orchestrator.commands" in perms(Role.ORCHESTRATOR).subscribe
    assert "_INBOX.>" in perms(Role.ORCHESTRATOR).publish  # its answers to the commands
    assert "ns.v1.orchestrator.progress" in perms(Role.ORCHESTRATOR).publish
    assert "ns.v1.orchestrator.progress" in perms(Role.OPERATOR).subscribe
    assert "$JS.API.STREAM.CREATE.KV_ns_v1_members" not in perms(Role.OPERATOR).publish


def test_only_routers_wake_models_and_the_orchestrator_hears_them() -> None:
    wakers = [user.name for user in stack_users(["w1"]) if "ns.v1.orchestrator.wake" in permissions(user, S).publish]
    assert wakers == ["router"]
    assert "ns.v1.orchestrator.wake" in perms(Role.ORCHESTRATOR).subscribe


def test_no_user_may_touch_other_streams_or_subscribe_to_everything() -> None:
    for user in stack_users(["w1", "w2"]):
        p = permissions(user, S)
        assert not [s for s in p.subscribe if s in (">", "_INBOX.>") or s.startswith("$")]
        assert ">" not in p.publish and "$JS.API.>" not in p.publish
        allowed = ("KV_ns_v1_members", "KV_ns_v1_responses") if user.role is Role.ROUTER else ("KV_ns_v1_members",)
        assert not [s for s in p.publish if s.startswith("$JS.API.") and not any(name in s for name in allowed)]
        if user.role is not Role.ROUTER:  # only routers store responses
            assert not [s for s in p.publish if "responses" in s]


def test_the_rendered_config_is_one_nats_server_accepts(tmp_path: Path) -> None:
    users = [AuthorizedUser(name=user.name, password_hash="$2b$06$" + "a" * 53, permissions=permissions(user, S))
             for user in stack_users(["w1"])]
    tls = ServerTls(cert_file=str(tmp_path / "c.pem"), key_file=str(tmp_path / "k.pem"), ca_file=str(tmp_path / "ca.pem"))
    text = render_server_config(users, None)
    config = tmp_path / "nats.conf"
    config.write_text(text)
    checked = subprocess.run([find_binary(), "-c", str(config), "-t"], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr
    with_tls = render_server_config(users, tls)
    assert "verify: true" in with_tls and "handshake_first: true" in with_tls


@pytest.mark.parametrize("url, shown", [
    ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
    ("nats://user:secret@10.0.0.1:4222", "nats://***@10.0.0.1:4222"),
    ("tls://token@nats.example:4222", "tls://***@nats.example:4222"),
    ("nats://a:b@h1:1,nats://h2:2", "nats://***@h1:1,nats://h2:2"),
])
def test_urls_are_shown_without_userinfo(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert has_userinfo(url) == (url != shown)


def test_credentials_files_are_private_and_never_print_the_password(tmp_path: Path) -> None:
    path = write_credentials(tmp_path / "sub" / "router.creds", Credentials(user="router", password='p"w\\d'))
    assert path.stat().st_mode & 0o777 == 0o600
    credentials = read_credentials(str(path))
    assert credentials == Credentials(user="router", password='p"w\\d')
    assert "p\"w" not in repr(credentials) and "p\"w" not in str(credentials)
    (tmp_path / "bad.creds").write_text("user = \n")
    with pytest.raises(CredentialsError, match="bad.creds is not a"):
        read_credentials(str(tmp_path / "bad.creds"))


def test_a_launched_service_gets_only_paths_and_unplanned_workers_have_no_user(tmp_path: Path) -> None:
    from launch.secure_nats import operator_bus, service_env
    from shared.nats_security import NatsSecurity

    security = NatsSecurity.create(tmp_path / "auth", "ns", ["p1"], tls=False)
    env = service_env(security, "p1")
    assert env == {"TANDEM_NATS_CREDS_FILE": str(tmp_path / "auth" / "creds" / "worker-p1.creds")}
    assert service_env(security, "router")["TANDEM_NATS_CREDS_FILE"].endswith("/router.creds")
    with pytest.raises(RuntimeError, match="d9 has no NATS user"):
        service_env(security, "d9")
    assert service_env(None, "p1") is None
    own = operator_bus(None, "tls://nats:4222", "ns", {"TANDEM_NATS_CREDS_FILE": "/run/op.creds",
                                                       "TANDEM_NATS_CA_FILE": "/run/ca.pem"})
    assert (own.creds_file, own.tls_ca_file, own.tls) == ("/run/op.creds", "/run/ca.pem", True)
    assert operator_bus(security, "nats://x:1", "ns").creds_file.endswith("/operator.creds")
