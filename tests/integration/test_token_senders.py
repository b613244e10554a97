"""Who may write a request's answer: only the instances the request was routed to.

A worker's NATS user could once send token chunks into any live request of any gateway, and the
gateway took them: one prefill instance wrote another tenant's answer. Each sender now publishes
on a subject of its own below the request's (schemas.subjects.tokens_from), which only its own
credentials may use, and a gateway takes a request's tokens only from the instances its route
named (a conductor: errors only). Driven against a real cluster with two prefill instances.
"""

from __future__ import annotations

import json
import signal

import nats
import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy

from common import bus
from schemas import subjects
from schemas.tokens import TokenChunk
from tests.integration.conftest import TINY, start_cluster, stream_tokens
from tests.wait import until
from tools.moonbus.cluster.security import instance_user

pytestmark = pytest.mark.integration
PROMPT = "the answer is written by whoever was asked"
FORGED = [5] * 6


@pytest.fixture(scope="module")
def two_prefills(tmp_path_factory, tiny_profile):
    cluster = start_cluster(tmp_path_factory.mktemp("senders"), profile=tiny_profile, prefill=2, decode=1)
    yield cluster
    cluster.stop()


async def routed_prefill(admin, request_id: str) -> str:
    """The prefill instance the conductor routed the request to (its `routed` event)."""
    sub = await admin.jetstream().subscribe(subjects.events_of_request(request_id), ordered_consumer=True,
                                            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    while True:
        event = json.loads((await sub.next_msg(timeout=60)).data)
        if event["kind"] == "routed":
            await sub.unsubscribe()
            return event["data"]["prefill_id"]


async def as_instance(cluster, name: str, errors: list[str]):
    user = instance_user(name)

    async def on_error(exc):
        errors.append(str(exc))

    return await nats.connect(cluster.spec.nats_addr, user=user, password=cluster.secrets.password(user),
                              error_cb=on_error, allow_reconnect=False, inbox_prefix=f"_INBOX_{user}")


async def streamed(cluster, body: dict, on_first_token=None) -> tuple[list[int], str | None]:
    return await stream_tokens(f"{cluster.spec.url}/v1/completions", body, on_first_token=on_first_token)


def spoofed_chunks(cluster) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{cluster.spec.url}/metrics", timeout=30).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "moonbus_gateway_spoofed_chunks_total")


async def test_a_worker_the_request_was_not_routed_to_cannot_write_its_answer(two_prefills):
    cluster = two_prefills
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True, "return_token_ids": True,
            "ignore_eos": True}
    honest, _ = await streamed(cluster, body)  # greedy: the answer the cluster gives when nobody meddles
    assert len(honest) == 8

    admin = await bus.connect(cluster.spec.nats_url, "test-senders")
    decode = cluster.procs["decode-0"].popen
    errors: list[str] = []
    attackers = []
    dropped_before = spoofed_chunks(cluster)

    async def forge(first: dict) -> None:
        request_id = first["id"]
        routed = await routed_prefill(admin, request_id)
        other = "prefill-1" if routed == "prefill-0" else "prefill-0"
        nc = await as_instance(cluster, other, errors)
        attackers.append(nc)
        forged = TokenChunk(request_id, 1, FORGED, finish_reason="stop", source=other)
        base = subjects.gateway_tokens("gateway")
        # on its own subject: the bus lets it through, the gateway drops it (not routed there)
        await nc.publish(subjects.tokens_from(base, "worker", other), forged.to_bytes())
        # on the routed instance's subject, or a conductor's: the bus refuses
        await nc.publish(subjects.tokens_from(base, "worker", routed), forged.to_bytes())
        await nc.publish(subjects.tokens_from(base, "conductor", "conductor"), forged.to_bytes())
        await bus.flush(nc)  # the broker's refusals come before its answer to the flush
        await until(lambda: spoofed_chunks(cluster) > dropped_before, "the gateway counts the dropped chunk")
        decode.send_signal(signal.SIGCONT)

    decode.send_signal(signal.SIGSTOP)  # the first token comes from prefill; the rest waits for decode
    try:
        tokens, finish = await streamed(cluster, body, on_first_token=forge)
    finally:
        decode.send_signal(signal.SIGCONT)
        for nc in attackers:
            await nc.close()
        await admin.drain()
    assert tokens == honest and finish == "length", (tokens, honest, finish)
    refused = [e for e in errors if "permissions violation" in e.lower()]
    assert len(refused) == 2 and any(".worker." in e for e in refused) and any(".conductor." in e for e in refused), errors
    assert not cluster.dead()
