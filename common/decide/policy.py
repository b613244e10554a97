"""The conductor's routing policy: choose (prefill, decode) for one request from a cluster snapshot.

Algorithm, `kvcache-centric` (docs/architecture.md, "The conductor"; the Mooncake paper's Conductor):

    best_len    = longest leading prefix of the request held on any node (blocks, any tier)
    best_holder = among nodes holding best_len blocks, the one with the fewest bytes queued at
                  its sender (least congested replica); ties by node name
    for each prefill instance p (p.local = holders[p.node], leading blocks held on p's node):
        if best_len > p.local * kvcache_balancing_threshold:      # remote cache is worth moving
            prefix = best_len
            t_transfer = (queued_bytes[best_holder] + bytes(best_len - p.local)) / link_bytes_s
        else:                                                      # recompute the difference
            prefix = p.local;  t_transfer = 0
        ttft[p] = p.queue_s + t_prefill(input_tokens, prefix tokens) * p.speed + t_transfer
    p* = argmin ttft (ties: lowest instance id)
    (p.speed and d.step_factor: what each instance really takes against the profile, learned
    from its measured work: common/decide/learn.py)
    d* = decode instance with the lowest predicted TBT once this request joins its batch
         (t_step(batch + 1, context + input_tokens) * d.step_factor); those within TBT_TIE (10%)
         of it are tied, and the one with fewer requests wins
         (ties: fewer requests there, then lowest instance id; a predictor that prices batch
         size at nothing makes every instance tie, and they must still share the load);
         instances without KV room for the prompt are skipped
    if p* pulls: Decision.pull = (best_holder, first block p*.local, best_len - p*.local blocks);
    p* keeps the pulled blocks, which is how hot prefixes get replicated (no prediction needed).

The other policies, kept for comparison, use the same decode choice (random: a random one):
    random          prefill and decode uniformly, from the snapshot's `random_draw`
    load-balancing  p* = least queue_s
    cache-aware     ttft = queue_s + t_prefill(input_tokens, local prefix); never transfers
Coupled instances (`colocate`): a coupled instance prefills and decodes on one node, so a
request must stay there; p* is chosen as above, but only among prefill instances whose node runs a
decode instance with KV room, and d* is the lowest-TBT one of those on p*'s node (random: the
draw's fraction picks among them).
Every policy prices every candidate with the same terms, so a decision event can be audited and
replayed. Admission (reject or not) is a separate step: common/decide/admission.py.

Settings (PolicySettings):
    policy                       one of POLICIES; default kvcache-centric
    kvcache_balancing_threshold  default 1.25 (>= 1). Each candidate is priced EITHER with the
        pull OR with recompute, never both, so the threshold is where pulling must be clearly
        worth it. Per token, moving KV is far cheaper than recomputing it (LLaMA3-70B on 8xA800:
        ~3 us over the NIC vs ~0.1 ms of compute; SmolLM2-135M on CPU over TCP loopback: ~50 us
        vs ~2 ms), so any gap pays on paper; what the formula does not see is the sender link
        taken from other pulls, the DRAM of a new replica, and the control round trip. 1.25
        keeps an instance that already holds most of the prefix from pulling a sliver, while a
        cold instance (local 0) always pulls.
    link_bytes_s                 default 1e9: TCP loopback through the messengers, conservative
                                 (`moonbus bench store` measures it); RDMA/NIC links are faster
    block_tokens                 tokens per KV block (must equal the cache index's); default 16
    kv_bytes_per_token           default 46080: SmolLM2-135M in float32 (30*2*3*64*4)
    colocate                     default False. True for coupled instances (`moonbus up --coupled`):
        decode on p*'s own node, so the KV never leaves the instance that computed it
The SLOs live in AdmissionSettings: with one TBT SLO for all, ranking decode instances by TBT is
ranking them by TBT / SLO, so the policy needs no SLO.

The module is pure: no I/O, no clock, no globals; randomness only from `random_draw`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Mapping, NamedTuple

from common.decide.perf import Profile, transfer_seconds

_new_row = tuple.__new__
POLICIES = ("random", "load-balancing", "cache-aware", "kvcache-centric")


@dataclass(frozen=True, slots=True)
class PolicySettings:
    policy: str = "kvcache-centric"
    kvcache_balancing_threshold: float = 1.25
    link_bytes_s: float = 1.0e9
    block_tokens: int = 16
    kv_bytes_per_token: int = 46080
    colocate: bool = False
    tbt_slo_s: float = 0.0  # decode TBTs closer than TBT_TIE_OF_SLO of it are ties (0: only TBT_TIE counts)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {POLICIES}")
        if not self.kvcache_balancing_threshold >= 1.0:
            raise ValueError("kvcache_balancing_threshold must be >= 1 (below 1 an equal prefix would be pulled)")
        if not self.link_bytes_s > 0:
            raise ValueError("link_bytes_s must be > 0")
        if self.block_tokens <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("block_tokens and kv_bytes_per_token must be > 0")

    @property
    def block_nbytes(self) -> int:
        return self.block_tokens * self.kv_bytes_per_token


# --------------------------------------------------------------------------- the snapshot


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str
    input_tokens: int
    num_blocks: int  # full blocks of the prompt (= number of block keys)
    kv_tokens: int = 0  # KV room it takes at decode (prompt and every token it may generate); 0: the prompt's


# NOTE: candidates hold instance state only, so the conductor can keep them between requests and
# rebuild one when its instance changes (dispatch, completion); what is specific to THIS request
# (leading blocks held per node) comes in ClusterSnapshot.holders, straight from the index match.


# NOTE: NamedTuples, like the costs below: every route builds every prefill candidate (its queue
# counts down with the clock), and a frozen dataclass takes five times as long to build.
class PrefillCandidate(NamedTuple):
    instance_id: str
    node: str
    queue_s: float  # predicted seconds of prefill work already queued at this instance
    speed: float = 1.0  # its prefills take the profile's prediction times this (learned: common/decide/learn.py)


class DecodeCandidate(NamedTuple):
    instance_id: str
    node: str
    num_running: int  # requests in its continuous batch
    context_tokens: int  # sum of their context lengths (KV tokens read per step)
    kv_free_tokens: int | None = None  # room left in its KV cache; None = not limited
    step_factor: float = 1.0  # its steps take the profile's prediction times this (learned)


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    now: float
    prefill: tuple[PrefillCandidate, ...]
    decode: tuple[DecodeCandidate, ...]
    holders: Mapping[str, int] = field(default_factory=dict)  # node -> leading blocks of this request held there
    sender_queued_bytes: Mapping[str, int] = field(default_factory=dict)  # node -> bytes queued at its messenger
    random_draw: float = 0.0  # uniform in [0, 1); the only source of randomness

    def __post_init__(self) -> None:
        if not 0.0 <= self.random_draw < 1.0:
            raise ValueError(f"random_draw {self.random_draw} not in [0, 1)")


# --------------------------------------------------------------------------- the decision


class PrefillCost(NamedTuple):
    """One prefill candidate, priced. ttft_s = queue_s + prefill_s + transfer_s."""

    instance_id: str
    node: str
    queue_s: float
    local_blocks: int  # held on its node
    prefix_blocks: int  # reused: local_blocks, or best_len when it pulls
    pull_blocks: int  # prefix_blocks - local_blocks
    prefill_s: float
    transfer_s: float
    ttft_s: float


class DecodeCost(NamedTuple):
    instance_id: str
    node: str
    num_running: int
    context_tokens: int
    tbt_s: float  # predicted step time with this request added
    fits: bool  # enough KV room for the prompt


@dataclass(frozen=True, slots=True)
class PullPlan:
    """Blocks [first_block, first_block + num_blocks) of the request, fetched from `source_node`."""

    source_node: str
    first_block: int
    num_blocks: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Decision:
    request_id: str
    policy: str
    prefill_id: str
    prefill_node: str
    decode_id: str
    decode_node: str
    prefix_blocks: int  # blocks p* will not recompute (local + pulled)
    pull: PullPlan | None
    ttft_s: float  # = queue_s + prefill_s + transfer_s of p*
    queue_s: float
    prefill_s: float
    transfer_s: float
    tbt_s: float  # predicted TBT on d* with this request
    best_len: int
    best_holder: str | None
    reason: str
    prefill_costs: tuple[PrefillCost, ...]  # every candidate, in snapshot order
    decode_costs: tuple[DecodeCost, ...]

    def to_event(self) -> dict[str, Any]:
        """JSON-ready data for the `routed` event: the choice, its terms and every candidate."""
        out = {name: getattr(self, name) for name in _EVENT_FIELDS}
        out["pull"] = None if self.pull is None else {
            "source_node": self.pull.source_node, "first_block": self.pull.first_block,
            "num_blocks": self.pull.num_blocks, "nbytes": self.pull.nbytes}
        # NOTE: as each cost's _asdict() would (its fields, in order), spelled out: a dict display
        # takes half the time of dict(zip(fields, cost)), and the conductor builds 2 x 16 per route
        out["prefill_costs"] = [{"instance_id": i, "node": n, "queue_s": q, "local_blocks": local, "prefix_blocks": prefix,
                                 "pull_blocks": pull, "prefill_s": p, "transfer_s": t, "ttft_s": ttft}
                                for i, n, q, local, prefix, pull, p, t, ttft in self.prefill_costs]
        out["decode_costs"] = [{"instance_id": i, "node": n, "num_running": running, "context_tokens": context,
                                "tbt_s": tbt, "fits": fits} for i, n, running, context, tbt, fits in self.decode_costs]
        return out

_EVENT_FIELDS = tuple(name for name in Decision.__slots__ if name not in ("pull", "prefill_costs", "decode_costs"))


@dataclass(frozen=True, slots=True)
class NoInstances:
    """No route exists. `overloaded`: decode instances exist but none has KV room for the prompt
    now (an overload: 429 with Retry-After); else no instance of a kind exists (503)."""

    request_id: str
    reason: str
    overloaded: bool = False
    role: str = ""  # the kind that has no instance ("prefill" or "decode"), when that is why


# --------------------------------------------------------------------------- the policy


def decide(request: RequestInfo, snapshot: ClusterSnapshot, settings: PolicySettings, perf: Profile) -> Decision | NoInstances:
    """Route `request` by `settings.policy`; every candidate is priced and returned with the choice."""
    if not snapshot.prefill:
        return NoInstances(request.request_id, "no prefill instance", role="prefill")
    decode_costs = price_decode(request, snapshot.decode, perf)
    fitting = [c for c in decode_costs if c.fits]
    if not fitting:
        if not decode_costs:
            return NoInstances(request.request_id, "no decode instance", role="decode")
        return NoInstances(request.request_id, "no decode instance has KV room for the prompt", overloaded=True)
    best_len, best_holder = best_prefix(snapshot)
    pulls = settings.policy == "kvcache-centric"
    prefill_costs = price_prefill(request, snapshot, settings, perf, best_len, best_holder, pulls)
    eligible = prefill_costs  # every candidate is priced (for the event); these may be chosen
    if settings.colocate:
        nodes = {c.node for c in fitting}
        eligible = tuple(c for c in prefill_costs if c.node in nodes)
        if not eligible:
            return NoInstances(request.request_id, "no prefill instance shares a node with a decode instance with KV room")

    if settings.policy == "random":
        p, d, reason = _random_pick(snapshot.random_draw, eligible, fitting, settings.colocate)
    else:
        if settings.policy == "load-balancing":
            p = min(eligible, key=_by_queue)
            reason = f"load-balancing: least queue {p.queue_s:.4f}s"
        else:
            p = min(eligible, key=_by_ttft)
            reason = _ttft_reason(settings, p, best_len, best_holder)
        if settings.colocate:
            d = lightest([c for c in fitting if c.node == p.node], settings.tbt_slo_s * TBT_TIE_OF_SLO)
            reason += f"; decode {d.instance_id}: colocated on {p.node}, tbt {d.tbt_s:.4f}s"
        else:
            d = lightest(fitting, settings.tbt_slo_s * TBT_TIE_OF_SLO)
            reason += f"; decode {d.instance_id}: lowest tbt {d.tbt_s:.4f}s"

    pull = None
    if p.pull_blocks > 0:
        pull = PullPlan(best_holder, p.local_blocks, p.pull_blocks, p.pull_blocks * settings.block_nbytes)  # type: ignore[arg-type]
    return Decision(request.request_id, settings.policy, p.instance_id, p.node, d.instance_id, d.node,
                    p.prefix_blocks, pull, p.ttft_s, p.queue_s, p.prefill_s, p.transfer_s, d.tbt_s,
                    best_len, best_holder, reason, prefill_costs, decode_costs)


def best_prefix(snapshot: ClusterSnapshot) -> tuple[int, str | None]:
    """(best_len, best_holder): the longest prefix anywhere and its least congested holder."""
    held = snapshot.holders
    best_len = max(held.values(), default=0)
    if best_len <= 0:
        return 0, None
    queued = snapshot.sender_queued_bytes.get
    # = min(nodes holding best_len, key=(queued bytes, name)), as a plain loop: no key call per node
    holder = None
    holder_q = 0
    for n, b in held.items():
        if b == best_len:
            q = queued(n, 0)
            if holder is None or q < holder_q or (q == holder_q and n < holder):
                holder, holder_q = n, q
    return best_len, holder


def price_prefill(request: RequestInfo, snapshot: ClusterSnapshot, settings: PolicySettings, perf: Profile,
                  best_len: int, best_holder: str | None, pulls: bool) -> tuple[PrefillCost, ...]:
    """Price every prefill candidate; with `pulls`, by the kvcache_balancing_threshold rule."""
    n = request.input_tokens
    bt = settings.block_tokens
    threshold = settings.kvcache_balancing_threshold
    prefill_seconds = perf.prefill.seconds
    queued = snapshot.sender_queued_bytes.get(best_holder, 0) if best_holder is not None else 0
    block_nbytes = settings.block_nbytes
    link = settings.link_bytes_s
    to_move = transfer_seconds
    # NOTE: at least the last prompt token is always computed (it yields the first token).
    max_prefix = max(n - 1, 0)
    held = snapshot.holders.get
    # local blocks -> (prefix blocks, transfer seconds, prefill seconds at the profile's speed): most
    # candidates' nodes hold the same few prefix lengths (often none), so each is priced once
    by_local: dict[int, tuple[int, float, float]] = {}
    by_prefix: dict[int, float] = {}  # prefix blocks -> prefill seconds (candidates share prefixes)
    costs = []
    append = costs.append
    for instance_id, node, queue_s, speed in snapshot.prefill:
        local = held(node, 0)
        priced = by_local.get(local)
        if priced is None:
            if pulls and best_len > local * threshold:
                prefix, transfer_s = best_len, to_move((best_len - local) * block_nbytes, link, queued)
            else:
                prefix, transfer_s = local, 0.0
            base_s = by_prefix.get(prefix)
            if base_s is None:
                base_s = by_prefix[prefix] = prefill_seconds(n, min(prefix * bt, max_prefix))
            priced = by_local[local] = prefix, transfer_s, base_s
        else:
            prefix, transfer_s, base_s = priced
        prefill_s = base_s * speed
        # NOTE: tuple.__new__ skips NamedTuple's Python-level __new__: half the cost on this hot path.
        append(_new_row(PrefillCost, (instance_id, node, queue_s, local, prefix, prefix - local,
                                      prefill_s, transfer_s, queue_s + prefill_s + transfer_s)))
    return tuple(costs)


def price_decode(request: RequestInfo, decode: tuple[DecodeCandidate, ...], perf: Profile) -> tuple[DecodeCost, ...]:
    """Predicted TBT of every decode instance once this request joins its batch."""
    step = perf.decode.step_seconds
    n = request.input_tokens
    room = request.kv_tokens or n
    costs = []
    append = costs.append
    for instance_id, node, running, context, free, factor in decode:
        append(_new_row(DecodeCost, (instance_id, node, running, context,
                                     step(running + 1, context + n) * factor, free is None or free >= room)))
    return tuple(costs)


# Sort keys, ties broken by instance id (C-level itemgetter: no Python call per candidate).
_by_ttft = itemgetter(PrefillCost._fields.index("ttft_s"), 0)
_by_queue = itemgetter(PrefillCost._fields.index("queue_s"), 0)
_by_running = itemgetter(DecodeCost._fields.index("num_running"), DecodeCost._fields.index("tbt_s"), 0)
_tbt = itemgetter(DecodeCost._fields.index("tbt_s"))
TBT_TIE = 0.1  # predicted TBTs this close are equal: below what the learned factors can tell apart
TBT_TIE_OF_SLO = 0.1  # ... and TBTs closer than this share of the TBT SLO: a difference that no SLO feels


def lightest(decode: list[DecodeCost], tie_s: float = 0.0) -> DecodeCost:
    """The decode instance with the lowest predicted TBT; instances within TBT_TIE of it, or within
    `tie_s` seconds, count as tied and the one with fewer requests wins (then the lowest id).
    NOTE: the per-instance factors learned from measurements carry noise (tens of percent on a
    shared, loaded machine), and a model whose step time hardly grows with the batch would
    otherwise send most requests to whichever instance measured fastest, far below the SLO,
    while one that is truly slower by more than the band still gets fewer."""
    best = min(map(_tbt, decode))
    limit = max(best * (1.0 + TBT_TIE), best + tie_s)
    return min([c for c in decode if c.tbt_s <= limit], key=_by_running)


def _random_pick(draw: float, prefill: tuple[PrefillCost, ...], decode: list[DecodeCost],
                 colocate: bool = False) -> tuple[PrefillCost, DecodeCost, str]:
    """Both picks from one uniform draw: floor(draw*P) picks p; frac(draw*P) is again uniform and
    picks d (with `colocate`, among those on p's node). Candidates are ordered by id first, so the
    snapshot's order does not matter."""
    ps = sorted(prefill, key=lambda c: c.instance_id)
    scaled = draw * len(ps)
    i = min(int(scaled), len(ps) - 1)
    ds = sorted((c for c in decode if not colocate or c.node == ps[i].node), key=lambda c: c.instance_id)
    j = min(int((scaled - i) * len(ds)), len(ds) - 1)
    return ps[i], ds[j], f"random: draw {draw:.4f} -> prefill {i + 1}/{len(ps)}, decode {j + 1}/{len(ds)}"


def _ttft_reason(settings: PolicySettings, p: PrefillCost, best_len: int, best_holder: str | None) -> str:
    head = f"{settings.policy}: min ttft {p.ttft_s:.4f}s (queue {p.queue_s:.4f} + prefill {p.prefill_s:.4f}"
    head += f" + transfer {p.transfer_s:.4f})"
    if p.pull_blocks:
        return (f"{head}; pulls {p.pull_blocks} blocks from {best_holder}"
                f" (best_len {best_len} > local {p.local_blocks} * {settings.kvcache_balancing_threshold:g})")
    if best_len > p.local_blocks and settings.policy == "kvcache-centric":
        return (f"{head}; recomputes {best_len - p.local_blocks} blocks"
                f" (best_len {best_len} <= local {p.local_blocks} * {settings.kvcache_balancing_threshold:g})")
    return f"{head}; local prefix {p.local_blocks} blocks"


def pipeline_stages(decision: Decision, snapshot: ClusterSnapshot, group: int, input_tokens: int,
                    chunk_tokens: int) -> tuple[str, ...] | None:
    """Chunked pipeline parallelism: the prefill instances that share a long prompt, or None.

    A prompt longer than one chunk, with nothing reused or pulled, runs on `group` instances: the
    chosen one and the least loaded others; chunk i on stage i mod group. NOTE: stages are in
    instance-id order so that every pipelined request visits shared instances in the same order
    (two requests waiting on each other's stages in opposite orders would deadlock).
    """
    if group < 2 or chunk_tokens <= 0 or input_tokens <= chunk_tokens or len(snapshot.prefill) < group:
        return None
    if decision.prefix_blocks or decision.pull is not None:
        return None
    others = sorted((p for p in snapshot.prefill if p.instance_id != decision.prefill_id),
                    key=lambda p: (p.queue_s, p.instance_id))[: group - 1]
    return tuple(sorted([decision.prefill_id, *(p.instance_id for p in others)]))
