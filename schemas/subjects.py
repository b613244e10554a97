"""Every NATS subject moonbus uses. Nothing else in the code spells a subject."""

from __future__ import annotations

# --- the audit log ------------------------------------------------------------------------
EVENTS_STREAM = "MOONBUS_EVENTS"
EVENTS_PREFIX = "moonbus.events"
EVENTS_ALL = "moonbus.events.>"


def request_event(kind: str, request_id: str) -> str:
    """moonbus.events.request.<kind>.<request_id>: one request's step."""
    return f"{EVENTS_PREFIX}.request.{kind}.{request_id}"


def kv_event(kind: str, node: str) -> str:
    """moonbus.events.kv.<kind>.<node>: a KV block changed state on a node."""
    return f"{EVENTS_PREFIX}.kv.{kind}.{node}"


def instance_event(kind: str, instance_id: str) -> str:
    """moonbus.events.instance.<kind>.<instance_id>: an instance joined, left or failed."""
    return f"{EVENTS_PREFIX}.instance.{kind}.{instance_id}"


def events_of_request(request_id: str) -> str:
    return f"{EVENTS_PREFIX}.request.*.{request_id}"


def events_of_kind(kind: str) -> str:
    return f"{EVENTS_PREFIX}.*.{kind}.>"


# --- control plane ------------------------------------------------------------------------
WORKER_HEARTBEAT_ALL = "moonbus.workers.heartbeat.*.*"  # everyone who tracks instances: every heartbeat
CONDUCTOR_ROUTE = "moonbus.conductor.route"  # gateway -> conductor, request/reply
CONDUCTOR_STATUS = "moonbus.conductor.status"  # anyone -> conductor, request/reply
CONDUCTOR_QUEUE = "conductor"  # queue group: replicated conductors share routes
REQUEST_CANCEL = "moonbus.requests.cancel"  # gateway -> all workers: stop this request
INDEX_QUERY = "moonbus.index.query"  # conductor -> cache_index, request/reply
INDEX_QUEUE = "cache_index"  # queue group: replicated cache indexes share queries (each follows every KV event)


def worker_heartbeat(role: str, instance_id: str) -> str:
    """moonbus.workers.heartbeat.<role>.<instance>: an instance -> everyone, every heartbeat_interval_s.
    On a closed bus each instance's credentials may publish only its own (tools/moonbus/cluster/security.py)."""
    return f"moonbus.workers.heartbeat.{role}.{instance_id}"


def speaks_for(subject: str, *claimed: str) -> bool:
    """Whether a message came from whom it claims to be: the last tokens of its subject (which the
    bus lets only that instance's credentials publish on) are the claimed role and/or instance id."""
    tokens = subject.split(".")
    return len(tokens) > len(claimed) and tokens[-len(claimed):] == list(claimed)


def prefill_tasks(instance_id: str) -> str:
    return f"moonbus.prefill.{instance_id}.tasks"


def decode_tasks(instance_id: str) -> str:
    return f"moonbus.decode.{instance_id}.tasks"


def worker_probe(instance_id: str) -> str:
    """moonbus.workers.<instance>.probe: gateway -> a prefill/decode instance: do you hold this request?"""
    return f"moonbus.workers.{instance_id}.probe"


CONTROL_PROGRESS_ALL = "moonbus.control.progress.*"  # conductors: every instance's progress


def control_progress(instance_id: str) -> str:
    """moonbus.control.progress.<instance>: a prefill/decode instance -> conductors (schemas.workers.Progress)."""
    return f"moonbus.control.progress.{instance_id}"


CONTROL_ALIVE_ALL = "moonbus.control.alive.*"  # conductors: every worker's liveness beacon
CONTROL_EXITED_ALL = "moonbus.control.exited.*"  # conductors: processes a supervisor saw exit


def control_alive(instance_id: str) -> str:
    """moonbus.control.alive.<instance>: a worker's liveness beacon, from a thread its compute
    cannot starve (schemas.workers.Alive): busy is not dead."""
    return f"moonbus.control.alive.{instance_id}"


def control_exited(instance_id: str) -> str:
    """moonbus.control.exited.<instance>: a supervisor -> conductors: that process exited (Exited)."""
    return f"moonbus.control.exited.{instance_id}"


def control_refused(instance_id: str) -> str:
    """moonbus.control.refused.<instance>: a conductor -> an instance that disagrees with the cluster."""
    return f"moonbus.control.refused.{instance_id}"


def messenger_control(node: str, op: str) -> str:
    """moonbus.messenger.<node>.<op>: control messages to a node's messenger (bytes never ride here)."""
    return f"moonbus.messenger.{node}.{op}"


TENANT_USAGE_ALL = "moonbus.tenants.usage.*"  # gateways: every gateway's tenants' usage


def tenant_usage(gateway_id: str) -> str:
    """moonbus.tenants.usage.<gateway>: one gateway's per-tenant counts, to the other gateways."""
    return f"moonbus.tenants.usage.{gateway_id}"


def gateway_tokens(gateway_id: str) -> str:
    """moonbus.tokens.<gateway_id>: where a gateway's requests send their tokens and terminal
    errors (a request's `reply_subject`); each sender publishes below it (tokens_from)."""
    return f"moonbus.tokens.{gateway_id}"


TOKEN_SENDERS = ("worker", "conductor")  # who may send a request's chunks: its routed workers; a conductor (errors)


def tokens_from(reply_subject: str, sender_kind: str, sender: str) -> str:
    """<reply_subject>.<worker|conductor>.<instance>: a chunk sent by that instance, which only its
    own credentials may publish on, so its gateway knows who sent it (sender_of)."""
    return f"{reply_subject}.{sender_kind}.{sender}"


def tokens_sent_to(reply_subject: str) -> str:
    """Every sender's chunks for one gateway (tokens_from)."""
    return f"{reply_subject}.*.*"


def sender_of(subject: str) -> tuple[str, str]:
    """(sender kind, instance) of a chunk's subject (tokens_from); ("", "") for any other subject."""
    tokens = subject.split(".")
    if len(tokens) != 5 or tokens[3] not in TOKEN_SENDERS:
        return "", ""
    return tokens[3], tokens[4]
INDEX_DUMP = "moonbus.index.dump"  # anyone -> cache_index: one node's entries, request/reply
KV_EVENTS_ALL = f"{EVENTS_PREFIX}.kv.>"
