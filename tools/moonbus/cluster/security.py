"""A cluster's secrets and its closed bus: one NATS user per role, each limited to its subjects.

`ClusterSecrets.create(dir)` makes, once per cluster (0600 files under `<home>/secrets`):
  cluster.key          the cluster secret (point-to-point links, the audit chain)
  nats-<role>.pw       a random password per NATS user
and `nats_config(...)` writes the nats-server configuration that admits exactly those users,
each with the permissions its role needs (ROLES below). Who may do what on the bus:

  gateway      route, status, cancel, probe; reads its own tokens; writes the events it owns
               (received, first_token, migrated and the terminal ones) and its own tenants' usage.
               No heartbeats, no KV events.
  conductor    reads heartbeats, progress, cancels, route requests; dispatches prefill tasks;
               answers status; asks the index; creates the events stream; writes routed events;
               for its own copy of the index (--prefix-index local) reads KV events and asks
               messengers for snapshots
  cache_index  reads KV events and heartbeats; answers queries; asks messengers for snapshots
  messenger    the only role that writes KV events; answers its node's pool ops
  prefill      reads its tasks, cancels, probes; sends tokens (as itself), progress, decode tasks, pool ops
  decode       reads its tasks, cancels, probes; sends tokens (as itself), progress, pool ops
  supervisor   writes restart events; with --autoscale reads the planner's events and the prefill
               and decode heartbeats, and writes what it started and drained (scaled_up, scaled_down, retired)
  auditor      reads the events stream (JetStream consumers), live or from its start; writes nothing
  admin        everything (operators' tools and tests)
Workers cannot write terminal events; nobody but a messenger writes a KV event; only the
gateway reads tokens, each sender's on a subject of its own (a conductor's: errors only), so a
gateway takes a request's tokens only from the instances it was routed to.

A process that speaks for instances (gateway, prefill, decode, coupled, messenger, cache index) gets a user
of its own where its launcher knows it (`moonbus up`: `instance_user(name)`, `processes` of
`nats_config`): its role's permissions, with heartbeats, progress, liveness and instance events
allowed only on its own instances' subjects (`{id}` in ROLES). A role's shared user (compose) has
`*` there: any instance of its role, never another role's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.bus import inbox_prefix
from common.security import kept_file, new_secret_file, private_dir

_HEARTBEAT = "moonbus.workers.heartbeat.*.*"  # every instance's heartbeats (subscribe)
_STARTED = "moonbus.events.instance.started.{id}"
ID = "{id}"  # in a subject: the publisher's own instance id (its own user), or any (a role's user)
NODE = "{node}"  # in a subject: the node of the publisher's own instances (its own user), or any


def _beat(role: str) -> str:
    """The heartbeat subject an instance of `role` publishes on: its role and its own id."""
    return f"moonbus.workers.heartbeat.{role}.{ID}"


def _events(*kinds: str) -> list[str]:
    return [f"moonbus.events.request.{kind}.*" for kind in kinds]


# role -> (publish, subscribe): every service role also reads its own inbox (_INBOX_<role>.>) and answers requests
ROLES: dict[str, tuple[list[str], list[str]]] = {
    "gateway": (
        ["moonbus.conductor.route", "moonbus.conductor.status", "moonbus.requests.cancel", "moonbus.workers.*.probe",
         "moonbus.messenger.*.status",
         *_events("received", "first_token", "migrated", "completed", "failed", "rejected", "cancelled"),
         f"moonbus.tenants.usage.{ID}"],
        [f"moonbus.tokens.{ID}.*.*", *_events("prefilled", "kv_pulled", "routed"), "moonbus.tenants.usage.*"],
    ),
    "conductor": (
        ["moonbus.prefill.*.tasks", "moonbus.tokens.*.conductor.*", "moonbus.control.refused.*", "moonbus.index.query",
         "moonbus.messenger.*.snapshot", *_events("routed", "pipelined"), "moonbus.events.instance.*.*",
         "$JS.API.INFO", "$JS.API.STREAM.CREATE.MOONBUS_EVENTS", "$JS.API.STREAM.INFO.MOONBUS_EVENTS"],
        [_HEARTBEAT, "moonbus.conductor.route", "moonbus.conductor.status", "moonbus.control.progress.*",
         "moonbus.control.alive.*", "moonbus.control.exited.*", "moonbus.requests.cancel", "moonbus.events.kv.>"],
    ),
    "cache_index": (
        [_beat("cache_index"), "moonbus.messenger.*.snapshot", "moonbus.events.instance.resynced.*"],
        ["moonbus.events.kv.>", _HEARTBEAT, "moonbus.index.query", "moonbus.index.dump"],
    ),
    "messenger": (
        [_beat("messenger"), f"moonbus.events.kv.*.{NODE}", _STARTED, f"moonbus.events.instance.link_refused.{ID}"],
        [_HEARTBEAT, f"moonbus.messenger.{NODE}.*", f"moonbus.control.refused.{ID}", "moonbus.control.alive.*"],
    ),
    "prefill": (
        [_beat("prefill"), f"moonbus.tokens.*.worker.{ID}", "moonbus.decode.*.tasks", "moonbus.messenger.*.lookup",
         "moonbus.messenger.*.reserve", "moonbus.messenger.*.commit", "moonbus.messenger.*.release",
         "moonbus.messenger.*.pull", "moonbus.messenger.*.accept", "moonbus.messenger.*.abort",
         f"moonbus.control.progress.{ID}", f"moonbus.control.alive.{ID}",
         *_events("prefilled", "kv_pulled", "kv_transferred", "prefill_stage", "rejected_late"), _STARTED],
        [f"moonbus.prefill.{ID}.tasks", "moonbus.requests.cancel", f"moonbus.workers.{ID}.probe", _HEARTBEAT,
         f"moonbus.control.refused.{ID}"],
    ),
    "decode": (
        [_beat("decode"), f"moonbus.tokens.*.worker.{ID}", "moonbus.messenger.*.reserve", "moonbus.messenger.*.commit",
         "moonbus.messenger.*.release", f"moonbus.control.progress.{ID}", f"moonbus.control.alive.{ID}",
         *_events("decode_finished", "decode_joined", "rejected_late"), _STARTED],
        [f"moonbus.decode.{ID}.tasks", "moonbus.requests.cancel", f"moonbus.workers.{ID}.probe", _HEARTBEAT,
         f"moonbus.control.refused.{ID}"],
    ),
    # with --autoscale it follows the planner and the workers' load, and says what it started and drained
    "supervisor": (["moonbus.events.instance.restarted.*", "moonbus.events.instance.crash_loop.*",
                    "moonbus.control.exited.*", "moonbus.events.instance.scaled_up.*",
                    "moonbus.events.instance.scaled_down.*", "moonbus.events.instance.retired.*"],
                   ["moonbus.events.instance.planned.*", "moonbus.workers.heartbeat.prefill.*",
                    "moonbus.workers.heartbeat.decode.*"]),
    "auditor": (
        ["$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.INFO.MOONBUS_EVENTS", "$JS.API.STREAM.MSG.GET.MOONBUS_EVENTS",
         "$JS.API.CONSUMER.CREATE.MOONBUS_EVENTS", "$JS.API.CONSUMER.CREATE.MOONBUS_EVENTS.>",
         "$JS.API.CONSUMER.INFO.MOONBUS_EVENTS.>", "$JS.API.CONSUMER.DELETE.MOONBUS_EVENTS.>",
         "$JS.API.CONSUMER.MSG.NEXT.MOONBUS_EVENTS.>", "$JS.FC.MOONBUS_EVENTS.>", "$JS.ACK.MOONBUS_EVENTS.>"],
        ["moonbus.events.>"],
    ),
}
# a coupled instance is a prefill and a decode instance in one process
ROLES["coupled"] = tuple(sorted(set(ROLES["prefill"][i]) | set(ROLES["decode"][i])) for i in range(2))  # type: ignore[assignment]
SERVICE_ROLES = ("gateway", "conductor", "cache_index", "messenger", "prefill", "decode", "coupled")
ALL_USERS = (*ROLES, "admin")
INSTANCE_ROLES = ("gateway", "cache_index", "messenger", "prefill", "decode", "coupled")  # they speak for an instance


def instance_user(name: str) -> str:
    """The NATS user of one process that speaks for instances (`moonbus up` gives each its own)."""
    return f"instance-{name}"


def permissions(role: str, ids: tuple[str, ...] = (), nodes: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """(publish, subscribe) of a role's user: with `ids`, a process's own user, which may publish
    heartbeats, progress, liveness and instance events only as those instances, and read only
    their tasks, probes and refusals (and, with `nodes`, a messenger's KV events and control
    messages only its node's); without, any instance of the role (a user the role's processes
    share, as compose gives them)."""
    def expand(subject: str) -> list[str]:
        for template, own in ((ID, ids), (NODE, nodes)):
            if template in subject:
                return [subject.replace(template, i) for i in own] if own else [subject.replace(template, "*")]
        return [subject]
    publish, subscribe = ROLES[role]
    return sorted({e for s in publish for e in expand(s)}), sorted({e for s in subscribe for e in expand(s)})


@dataclass(frozen=True)
class ClusterSecrets:
    directory: Path

    @classmethod
    def create(cls, directory: Path) -> "ClusterSecrets":
        """The cluster's secrets, made once and kept (a restarted process finds them again), in a
        directory, and a home around it, that are this user's alone: one that is a link, another
        user's, or writable by others is refused (private_dir, kept), as is a link or another
        user's file in place of a secret (it would be trusted as the cluster's)."""
        private_dir(directory.parent, kept=True)  # the cluster's home
        private_dir(directory, kept=True)
        secrets = cls(directory)
        for path in [secrets.cluster_key] + [secrets.password_file(user) for user in ALL_USERS]:
            if not kept_file(path):
                new_secret_file(path, 24)
        return secrets

    def ensure_user(self, user: str) -> Path:
        """The password file of a user made after the cluster's (a process's own): made once, then kept."""
        path = self.password_file(user)
        if not kept_file(path):
            new_secret_file(path, 24)
        return path

    @property
    def cluster_key(self) -> Path:
        return self.directory / "cluster.key"

    def password_file(self, user: str) -> Path:
        return self.directory / f"nats-{user}.pw"

    def password(self, user: str) -> str:
        return self.password_file(user).read_text().strip()

    def url(self, address: str, user: str) -> str:
        """nats://user:password@host:port, for a tool run by an operator (never logged)."""
        scheme, rest = address.split("://", 1)
        return f"{scheme}://{user}:{self.password(user)}@{rest}"


@dataclass(frozen=True)
class NatsRoutes:
    """The `cluster` block of one server of a NATS cluster: where it listens for the other
    servers and the routes to them (nats://host:port each; its own may be among them). Every
    server has JetStream on, so a stream can keep replicas on several (see --events-replicas).
    With a password, a server accepts routes only from servers that know it."""

    name: str  # the cluster's name, equal on every server
    host: str
    port: int
    routes: tuple[str, ...]
    password: str = ""  # the routes' shared secret ("" = routes unauthenticated)

    USER = "route"
    # A server whose route went silent (its host's cable pulled) is dropped after PING_MAX unanswered
    # pings, and with it the subscriptions it held: until then the others still send it requests
    # for queue groups whose members moved on (a conductor failed over, say), and those are lost.
    # nats-server's default is 2 minutes times 2; this is what the clients use (common.bus).
    PING_INTERVAL = "2s"
    PING_MAX = 2

    def block(self) -> dict:
        routes = list(self.routes)
        block: dict = {"name": self.name, "host": self.host, "port": self.port,
                       "ping_interval": self.PING_INTERVAL, "ping_max": self.PING_MAX}
        if self.password:
            block["authorization"] = {"user": self.USER, "password": self.password}
            routes = [r.replace("://", f"://{self.USER}:{self.password}@", 1) for r in routes]
        return block | {"routes": routes}


def nats_config(secrets: ClusterSecrets, host: str, port: int, store_dir: Path, name: str,
                http_port: int | None = None, routes: NatsRoutes | None = None,
                processes: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] | None = None) -> str:
    """The nats-server configuration: JetStream on, and only the cluster's users, each limited
    (`http_port`: the monitoring endpoint, e.g. for a health check's /healthz; `routes`: this
    server's place in a cluster of servers, its routes authenticated by their own secret;
    `processes`: name -> (role, instance ids, nodes) of the processes that get a user of their own,
    `instance_user(name)`, allowed to speak only for those instances and, a messenger, its node;
    then the roles' shared users that speak for instances (INSTANCE_ROLES: rights over every
    instance of their role, what compose gives each container) are not users of this server)."""
    users = []
    own = {instance_user(n): spoken for n, spoken in (processes or {}).items()}
    shared = [user for user in ALL_USERS if not (processes and user in INSTANCE_ROLES)]
    for user in (*shared, *own):
        entry: dict = {"user": user, "password": secrets.password(user)}
        if user != "admin":
            role, ids, nodes = own.get(user, (user, (), ()))
            publish, subscribe = permissions(role, ids, nodes)
            allowed: dict = {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}}
            if role in SERVICE_ROLES or role in ("auditor", "supervisor"):  # replies: requests, JetStream acks
                # its own inbox only (common.bus.connect asks replies there): no user reads another's replies
                allowed["subscribe"]["allow"] = sorted(set(subscribe) | {f"{inbox_prefix(user)}.>"})
            if role in SERVICE_ROLES:
                allowed["allow_responses"] = True
            entry["permissions"] = allowed
        users.append(entry)
    # JSON is valid nats-server configuration syntax
    config = {"server_name": name, "host": host, "port": port,
              "jetstream": {"store_dir": str(store_dir)}, "authorization": {"users": users}}
    if http_port is not None:
        config["http_port"] = http_port
    if routes is not None:  # one server of a cluster: server names must differ, the cluster name not
        config["cluster"] = routes.block()
    return json.dumps(config, indent=1)


def local_access(state: dict, user: str):
    """(NATS address, NatsAuth) for an operator's tool on the machine of a local cluster, from its
    cluster.json: `moonbus tap` connects as the read-only auditor, `moonbus soak` as admin."""
    from common.config import NatsAuth

    password_file = state.get("nats_credentials", {}).get(user, "")
    return state["nats_url"], NatsAuth(user, password_file) if password_file else None
