"""Who may do what on NATS: one user per service, its subject permissions, and the
nats-server configuration that enforces them. Pure: no I/O (files and hashing are
`shared.nats_secrets`'s, certificates `shared.nats_tls`'s).

Roles and what they may do (subjects from the catalog, `shared.subjects`):
- worker W: serve its own `worker.W.generate`, `ctl.W.*`, `kv.lease.W`, `kv.release.W`;
  publish its own KV events, load, transfer records and registration (`$KV.<members>.W`);
  ask other workers for leases (`kv.lease.*`: only workers may) and tell a reader its
  pushed KV is done (`ctl.*.push_done`); answer callers on their inboxes.
- router: send generate requests, `Cancel`s (`ctl.*.cancel`) and KV snapshot requests
  (`ctl.*.kv_snapshot`), release the leases it arranged (`kv.release.*`); read KV events,
  load and membership; publish request records; share its predicted load with the other
  routers (`router.load.*`: router ids are per process, so any router id); create, read and
  write the responses bucket (`/v1/responses` with `store`: `$KV.<responses>.>`).
- orchestrator: read membership, delete dead workers' registrations, publish changes; take
  operator commands and send workers their admin messages (set_role, cordon, uncordon, drain,
  load_adapter, unload_adapter).
- metrics: read events, load, transfer and request records, membership; ask for KV snapshots.
- operator (the launcher, `tandem` tools): read membership; drain workers (`ctl.*.drain`);
  send the orchestrator commands (`tandem ctl`).

The shared worker user (`shared_worker_user`, the Kubernetes stack's: its workers' ids are
their pod names, known only once they run) has the worker permissions with `*` for the
worker id: weaker, a worker holding it can serve, publish and answer as any other worker
(its generate requests, control messages, leases, KV events, load and registration). The
other roles keep their guarantees. The Docker Compose stack has none: its workers claim
worker slots (`shared.worker_slots`), fixed ids made up front with a user each.

Every user subscribes only under its own inbox prefix (`_INBOX.<user>.>`, so nobody reads
another's replies) and may publish to any inbox (replies). JetStream access is narrowed
to the members bucket's stream (`KV_<bucket>`) and its `$KV.<bucket>.` subjects, and for
routers to the responses bucket's.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from urllib.parse import urlsplit, urlunsplit

import msgspec

from shared.subjects import Subjects, check_token

_ANY = "__any__"  # a placeholder worker id, replaced by the `*` wildcard in patterns


class Role(str, Enum):
    WORKER = "worker"
    ROUTER = "router"
    ORCHESTRATOR = "orchestrator"
    METRICS = "metrics"
    OPERATOR = "operator"


class Permissions(msgspec.Struct, frozen=True, kw_only=True):
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # may answer each request it receives, once (`allow_responses`), without publishing to
    # inboxes at large: the router answering the workers' probes of its streams' inboxes
    responses: bool = False


class NatsUser(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    role: Role
    worker_id: str = ""  # workers only; empty for the shared worker user: any worker id


SHARED_WORKER = "worker"


def shared_worker_user() -> NatsUser:
    """One user for every worker, whatever its id (workers named at run time). Weaker than a
    user per worker: whoever holds it may act as any worker (see the module's docstring)."""
    return NatsUser(name=SHARED_WORKER, role=Role.WORKER)


def user_name(role: Role, worker_id: str = "") -> str:
    """The NATS user of a service: its role, and for a worker its id (`worker-w1`)."""
    if role is Role.WORKER:
        return f"worker-{check_token(worker_id, 'worker id')}"
    return role.value


def stack_users(worker_ids: list[str] | tuple[str, ...], *, shared_worker: bool = False) -> list[NatsUser]:
    """The users of one stack: the control services, the operator, one per worker (and with
    `shared_worker` the one user any worker may use)."""
    fixed = [NatsUser(name=user_name(role), role=role)
             for role in (Role.ROUTER, Role.ORCHESTRATOR, Role.METRICS, Role.OPERATOR)]
    if shared_worker:
        fixed.append(shared_worker_user())
    return fixed + [NatsUser(name=user_name(Role.WORKER, w), role=Role.WORKER, worker_id=w) for w in worker_ids]


def inbox_prefix(user: str) -> str:
    """The inbox prefix a user's client uses (`nats.connect(inbox_prefix=...)`)."""
    return f"_INBOX.{check_token(user, 'NATS user')}"


def _wild(subject_of, *args: str) -> str:
    return subject_of(_ANY, *args).replace(_ANY, "*")


def _jetstream(bucket: str, *, create: bool) -> list[str]:
    """The JetStream API a client of the members bucket uses: bind (stream info), get
    (direct and message get), watch (ordered consumers: create, delete, flow control)."""
    stream = f"KV_{bucket}"
    subjects = [f"$JS.API.STREAM.INFO.{stream}",
                f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
                f"$JS.API.STREAM.MSG.GET.{stream}",
                f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
                f"$JS.API.CONSUMER.DELETE.{stream}.>", f"$JS.API.CONSUMER.INFO.{stream}.>",
                f"$JS.FC.{stream}.>"]
    if create:  # the first of its users to start creates it (`Bus.key_value`)
        subjects.append(f"$JS.API.STREAM.CREATE.{stream}")
    return subjects


def permissions(user: NatsUser, subjects: Subjects) -> Permissions:
    """What `user` may publish and subscribe to in the namespace of `subjects`."""
    s = subjects
    bucket = s.members_bucket
    inbox = inbox_prefix(user.name)
    subscribe = [f"{inbox}.>"]
    publish: list[str] = []
    match user.role:
        case Role.WORKER:
            w = user.worker_id or _ANY

            def own(subject: str) -> str:  # the shared worker user: any worker's subject
                return subject if user.worker_id else subject.replace(_ANY, "*")

            subscribe += [own(s.generate(w)), own(s.control_all(w)), own(s.kv_lease(w)), own(s.kv_release(w))]
            publish += ["_INBOX.>", own(s.kv_events(w)), own(s.load(w)), own(s.kv_transfers(w)),
                        own(f"$KV.{bucket}.{w}"),
                        _wild(s.kv_lease), _wild(s.control, "push_done"), *_jetstream(bucket, create=True)]
        case Role.ROUTER:
            subscribe += [s.kv_events_all, s.load_all, s.router_load_all]
            publish += [_wild(s.generate), _wild(s.control, "cancel"), _wild(s.control, "kv_snapshot"),
                        _wild(s.kv_release), s.request_events, s.router_load_all, s.orchestrator_wake,
                        *_jetstream(bucket, create=True),
                        f"$KV.{s.responses_bucket}.>", *_jetstream(s.responses_bucket, create=True)]
        case Role.ORCHESTRATOR:  # commands in; admin messages to workers (answered to its inbox)
            subscribe += [s.orchestrator_commands, s.orchestrator_wake]
            publish += [s.orchestrator_progress]
            publish += ["_INBOX.>", s.membership_changes, f"$KV.{bucket}.>", *_jetstream(bucket, create=True),
                        *(_wild(s.control, kind) for kind in ("set_role", "cordon", "uncordon", "drain", "load_adapter",
                                                              "unload_adapter"))]
        case Role.METRICS:
            subscribe += [s.kv_events_all, s.load_all, s.kv_transfers_all, s.request_events, s.membership_changes]
            publish += [_wild(s.control, "kv_snapshot"), *_jetstream(bucket, create=True)]
        case Role.OPERATOR:  # also `tandem ctl`: commands to the orchestrator, and their progress
            subscribe += [s.orchestrator_progress]
            publish += [_wild(s.control, "drain"), s.orchestrator_commands, *_jetstream(bucket, create=False)]
    if user.role is Role.ORCHESTRATOR:  # its SLO planner: load and request records in, decisions out
        subscribe += [s.load_all, s.request_events]
        publish += [s.planner_decisions]
    return Permissions(publish=tuple(publish), subscribe=tuple(subscribe), responses=user.role is Role.ROUTER)


class ServerTls(msgspec.Struct, frozen=True, kw_only=True):
    cert_file: str
    key_file: str
    ca_file: str
    verify: bool = True  # clients must show a certificate the CA signed


class AuthorizedUser(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    password_hash: str  # bcrypt
    permissions: Permissions


def _quote(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid nats-server config string


def _list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(_quote(v) for v in values) + "]"


def render_server_config(users: list[AuthorizedUser], tls: ServerTls | None = None) -> str:
    """A nats-server configuration file: the users with their permissions (everything not
    allowed is denied), and TLS when given. Host, port and JetStream stay on the command line."""
    lines = ["authorization {", "  users = ["]
    for user in users:
        lines += ["    {",
                  f"      user: {_quote(user.name)}",
                  f"      password: {_quote(user.password_hash)}",
                  "      permissions: {",
                  f"        publish: {{ allow: {_list(user.permissions.publish)} }}",
                  f"        subscribe: {{ allow: {_list(user.permissions.subscribe)} }}",
                  *(["        allow_responses: true"] if user.permissions.responses else []),
                  "      }",
                  "    }"]
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n" + (render_tls_config(tls) if tls is not None else "")


def render_tls_config(tls: ServerTls) -> str:
    """The server configuration's `tls` block (also used alone, beside users kept elsewhere)."""
    lines = ["tls {",
             f"  cert_file: {_quote(tls.cert_file)}",
             f"  key_file: {_quote(tls.key_file)}",
             f"  ca_file: {_quote(tls.ca_file)}",
             f"  verify: {'true' if tls.verify else 'false'}",
             "  handshake_first: true",  # TLS before the server says anything: no plain-text start
             "  timeout: 2",
             "}"]
    return "\n".join(lines) + "\n"


_USERINFO = re.compile(r"//[^/@\s]*@")


def redact_url(url: str) -> str:
    """`url` without any user or password in it (`nats://u:p@h:4222` -> `nats://***@h:4222`),
    for logs and status output. Several comma-separated URLs are redacted each."""
    if "," in url:
        return ",".join(redact_url(part) for part in url.split(","))
    try:
        parts = urlsplit(url)
    except ValueError:
        return _USERINFO.sub("//***@", url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


def has_userinfo(url: str) -> bool:
    return redact_url(url) != url
