"""The bus: NATS as every service uses it, in four parts.

- connection.py: connect to any server of a cluster, reconnect forever, give up after a long
  outage (`watchdog`), shut down without losing what is queued; a `Connection` keeps the bus's
  state of one client (its reconnects, the subjects it was refused, its event publishers).
- subscriptions.py: subscriptions whose handlers never take them down, typed ones (`receive`)
  that decode their wire type and drop a bad message in one place, and publishes that never raise.
- calls.py: request/reply that waits out a broker blip and asks again under one call id, and
  `Replies`, which runs each call once however often it arrives.
- events.py: the audit events stream and the publisher that gets every event stored, in order.

A broker blip must fail nothing: the client reconnects forever and buffers what is published
meanwhile; a call waits out an outage and asks again; publishes and handlers never raise into a
service's loop. Only a bad message is lost, and it is logged.
"""

from common.bus.calls import ATTEMPT_S, CALL_ID_HEADER, Replies, request
from common.bus.connection import (
    BROKER_GIVE_UP_S, OUTAGE_S, PENDING_BYTES, BrokerGone, Connection, connect, flush, inbox_prefix, server_urls,
    shutdown, url_user, watchdog,
)
from common.bus.events import EVENT_ACK_S, EVENT_MAX_AGE_S, EVENT_QUEUE_MAX, EVENT_WINDOW, EventPublisher, ensure_events_stream
from common.bus.subscriptions import heartbeat, publish, receive, subscribe

__all__ = [
    "ATTEMPT_S", "BROKER_GIVE_UP_S", "CALL_ID_HEADER", "EVENT_ACK_S", "EVENT_MAX_AGE_S", "EVENT_QUEUE_MAX",
    "EVENT_WINDOW", "OUTAGE_S", "PENDING_BYTES", "BrokerGone", "Connection", "EventPublisher", "Replies", "connect",
    "ensure_events_stream", "flush", "heartbeat", "inbox_prefix", "publish", "receive", "request", "server_urls",
    "shutdown", "subscribe", "url_user", "watchdog",
]
