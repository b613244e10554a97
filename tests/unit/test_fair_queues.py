"""Queues inside the cluster share fairly between tenants (common/decide/queue_order.py): a small
request of one tenant is not held behind another tenant's burst, at a prefill instance's queue nor
while it waits for KV room at a decode instance; one tenant alone is served as before, in arrival
order (the simulator, which has no tenants, schedules exactly as it did)."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import random
from types import SimpleNamespace

from common.decide.queue_order import MAX_PASSED, FairOrder, next_to_admit
from schemas.decode import DecodeTask
from schemas.prefill import PipelineSpec, PrefillTask
from schemas.route import SamplingParams
from schemas.transfer import KvHandle
from services.decode.join import Joins
from services.prefill.queue import ArrivalQueue


def task(rid: str, arrival: float, tenant: str = "", tokens: int = 3, pipeline: bool = False) -> PrefillTask:
    spec = PipelineSpec(["prefill-0", "prefill-1"], ["127.0.0.1:1", "127.0.0.1:2"], 64) if pipeline else None
    return PrefillTask(rid, [1] * tokens, SamplingParams(max_tokens=4), "_INBOX.x", "decode-0", "node-d0", arrival,
                       pipeline=spec, tenant=tenant)


def drain(queue: ArrivalQueue) -> list[str]:
    async def main() -> list[str]:
        return [(await queue.get()).request_id for _ in range(queue.qsize())]
    return asyncio.run(main())


def test_a_short_prompt_of_another_tenant_goes_second_not_behind_a_burst_of_long_ones():
    queue = ArrivalQueue()
    for i in range(20):
        queue.put_nowait(task(f"a{i}", 10.0 + i, "acme", tokens=4000))
    queue.put_nowait(task("b", 40.0, "globex", tokens=20))
    assert [t.request_id for t in queue.tasks()][:3] == ["a0", "b", "a1"]  # what the conductors are told
    assert drain(queue)[:3] == ["a0", "b", "a1"]


def test_a_burst_already_begun_does_not_hold_back_a_tenant_that_comes_later():
    async def main() -> list[str]:
        queue = ArrivalQueue()
        for i in range(20):
            queue.put_nowait(task(f"a{i}", 10.0 + i, "acme", tokens=4000))
        order = [(await queue.get()).request_id]  # a0 runs
        queue.put_nowait(task("b", 40.0, "globex", tokens=20))
        return order + [(await queue.get()).request_id for _ in range(queue.qsize())]

    order = asyncio.run(main())
    assert order[:3] == ["a0", "b", "a1"]


def test_tenants_are_served_in_turn_by_the_prompt_tokens_each_is_served():
    queue = ArrivalQueue()
    for i in range(3):
        queue.put_nowait(task(f"a{i}", 10.0 + i, "acme", tokens=1000))
    for i in range(25):
        queue.put_nowait(task(f"b{i}", 20.0 + i, "globex", tokens=100))
    order = drain(queue)
    assert order[:12] == ["a0"] + [f"b{i}" for i in range(10)] + ["a1"]  # ten short prompts weigh one long
    assert order[12:23] == [f"b{i}" for i in range(10, 20)] + ["a2"]


def test_a_tenant_that_was_idle_banks_no_credit_to_burst_with_later():
    order: FairOrder[str] = FairOrder()
    order.push("b0", 0.5, tenant="globex", cost=1000)
    for i in range(13):
        order.push(f"a{i}", float(i), tenant="acme", cost=1000)
    served = [order.pop() for _ in range(11)]  # a0, b0, a1 ... a9: globex had nothing more
    assert served[:3] == ["a0", "b0", "a1"]
    for i in (1, 2, 3):
        order.push(f"b{i}", 20.0 + i, tenant="globex", cost=1000)
    assert order.items() == ["b1", "a10", "b2", "a11", "b3", "a12"]  # in turn, not b1 b2 b3 at once
    assert [order.pop() for _ in range(len(order))] == ["b1", "a10", "b2", "a11", "b3", "a12"]


def test_pipeline_stages_run_in_the_order_they_came_whatever_their_tenants():
    """Each instance of a group has served its tenants differently: were stages reordered by
    tenant, two instances could run two requests' stages in opposite orders and wait on each other."""
    queue = ArrivalQueue()
    for i in range(5):
        queue.put_nowait(task(f"a{i}", float(i), "acme", tokens=1000))
    assert drain(queue) == ["a0", "a1", "a2", "a3", "a4"]  # acme has been served much here
    queue.put_nowait(task("stage-a", 1.0, "acme", tokens=1000, pipeline=True))
    queue.put_nowait(task("stage-b", 2.0, "globex", tokens=1000, pipeline=True))
    queue.put_nowait(task("c", 30.0, "initech", tokens=10))
    assert [t.request_id for t in queue.tasks()] == ["c", "stage-a", "stage-b"]
    assert drain(queue) == ["c", "stage-a", "stage-b"]


class OldArrivalOrder:
    """The order before tenants (arrival, stages at the back): one tenant must still get exactly it."""

    def __init__(self) -> None:
        self.entries: list = []
        self.seq = itertools.count()

    def push(self, item, arrival: float, last: bool = False) -> None:
        key = max(arrival, self.entries[-1][0]) if last and self.entries else arrival
        bisect.insort(self.entries, (key, next(self.seq), item))

    def pop(self):
        return self.entries.pop(0)[2]


def test_one_tenant_alone_is_served_exactly_in_arrival_order():
    rnd = random.Random(5)
    for tenant in ("", "acme"):
        new, old = FairOrder(), OldArrivalOrder()
        got, want = [], []
        for i in range(400):
            if rnd.random() < 0.6 or not old.entries:
                arrival, last = float(rnd.randint(0, 50)), rnd.random() < 0.2  # resumed attempts, stages
                new.push(i, arrival, last, tenant=tenant, cost=rnd.randint(1, 5000))
                old.push(i, arrival, last)
            else:
                assert new.items() == [entry[2] for entry in old.entries]
                got.append(new.pop())
                want.append(old.pop())
        assert got == want and len(got) > 100


def test_what_waits_is_reported_in_the_order_it_will_run():
    rnd = random.Random(8)
    order: FairOrder[int] = FairOrder()
    for step in range(300):
        if rnd.random() < 0.6 or not len(order):
            order.push(step, float(rnd.randint(0, 50)), rnd.random() < 0.1, tenant=rnd.choice("abcd"),
                       cost=rnd.randint(1, 3000))
        else:
            expected = order.items()
            assert order.pop() == expected[0]
    expected = order.items()
    assert [order.pop() for _ in range(len(order))] == expected


# --- decode: waiting for KV room -----------------------------------------------------------------------

def admit(waiting: list[tuple[str, int]], room: int, passed: dict[int, int] | None = None):
    """(tenant, tokens needed) in arrival order."""
    passed = passed or {}
    return next_to_admit(range(len(waiting)), lambda i: waiting[i][0], lambda i: waiting[i][1] <= room,
                         lambda i: passed.get(i, 0))


def test_a_request_that_does_not_fit_does_not_block_another_tenants_that_does():
    assert admit([("acme", 900), ("acme", 10), ("globex", 10)], room=100) == (2, [0])


def test_one_tenant_waits_first_come_first_served_for_room():
    assert admit([("acme", 900), ("acme", 10)], room=100) == (None, [])
    assert admit([("", 900), ("", 10)], room=100) == (None, [])
    assert admit([("acme", 10), ("globex", 10)], room=100) == (0, [])


def test_a_request_passed_often_enough_holds_its_place_at_the_head():
    assert admit([("acme", 900), ("globex", 10)], room=100, passed={0: MAX_PASSED}) == (None, [])
    # one further back, passed often enough, holds back what is behind it, not what is ahead
    waiting = [("acme", 900), ("initech", 10), ("globex", 900), ("hooli", 10)]
    assert admit(waiting, room=100, passed={2: MAX_PASSED}) == (1, [0])
    assert admit(waiting[:1] + waiting[2:], room=100, passed={1: MAX_PASSED}) == (None, [])


class Engine:
    """A batch's KV room as the way in sees it: tokens needed = prompt tokens."""

    def __init__(self, budget: int, used: int) -> None:
        self.kv_budget_tokens, self.used = budget, used
        self.reserved: list[str] = []

    def tokens_needed(self, prompt_tokens: int, sampling, generated: int) -> int:
        return prompt_tokens

    def can_admit(self, tokens: int) -> bool:
        return self.used + tokens <= self.kv_budget_tokens

    def reserve(self, request_id: str, tokens: int, kv_len: int = 0) -> None:
        assert self.can_admit(tokens)
        self.used += tokens
        self.reserved.append(request_id)

    def load_file(self, *args, **kwargs):
        return None


def decode_task(rid: str, tenant: str, tokens: int) -> DecodeTask:
    kv = KvHandle("node-d0", f"{rid}.kv", [1, 2, 1, tokens, 4], "float32", 0)
    return DecodeTask(rid, [1] * tokens, 7, SamplingParams(max_tokens=4), "_INBOX.x", kv, 1.0, tenant=tenant)


def test_at_a_decode_instance_a_large_request_lets_other_tenants_join_only_a_few_times():
    async def main() -> tuple[list[list[str]], Joins]:
        engine = Engine(budget=1000, used=800)  # 200 tokens free: the large one does not fit
        service = SimpleNamespace(engine=engine, cfg=SimpleNamespace(shm_dir="/nonexistent"), wakeup=asyncio.Event(),
                                  metrics=SimpleNamespace(load_s=SimpleNamespace(observe=lambda s: None)))
        joins = Joins(service)
        joins.waiting.extend([decode_task("large", "acme", 500), decode_task("acme-small", "acme", 1)])
        joins.waiting.extend(decode_task(f"g{i}", "globex", 1) for i in range(MAX_PASSED + 3))
        rounds = []
        while True:
            await joins.admit_waiting()
            admitted = list(joins.loading)
            if not admitted:
                break
            rounds.append(admitted)
            await asyncio.gather(*(e.job for e in joins.loading.values()))
            joins.loading.clear()  # joined the batch
        return rounds, joins

    rounds, joins = asyncio.run(main())
    assert sum(rounds, []) == [f"g{i}" for i in range(MAX_PASSED)]  # not acme's small one: behind its own large one
    assert joins.passed == {"large": MAX_PASSED}
    assert [t.request_id for t in joins.waiting] == ["large", "acme-small", "g8", "g9", "g10"]


def test_iterating_gives_what_waits_as_items_does_in_no_particular_order():
    queue: FairOrder[str] = FairOrder()
    for i, tenant in enumerate(("a", "b", "a", "c", "b")):
        queue.push(f"{tenant}{i}", float(i), tenant=tenant, cost=1 + i)
    queue.push("stage", 0.5, last=True)
    assert sorted(queue) == sorted(queue.items())
    queue.pop()
    assert sorted(queue) == sorted(queue.items()) and len(list(queue)) == len(queue)
