"""The route of one request: the conductor's whole decision, run alike by the live conductor
(services/conductor/service.py), the simulator (tools/sim/engine.py) and the conductor bench
(tools/moonbus/bench/conductor.py).

    prefix    how many leading blocks of the request each node holds (the index's longest match)
    snapshot  the candidates as the cluster state sees them now (every report heard), with those
    decide    the policy's (prefill, decode), every candidate priced (policy.decide); where none:
                - a request no decode instance could ever hold (prompt and every token it may
                  generate beyond the largest KV room): 400, waiting would not help
                - no KV room now: the room freed as requests leave within the TTFT SLO
                  (admission.room_within): the request waits in that instance's queue; else 429
                  with the Retry-After until room frees (admission.kv_retry_after)
                - no instance of a kind: 429 while one is being restarted (RECOVERY_RETRY_S),
                  else 503
    judge     admission (admission.judge): 429 with a Retry-After when an SLO would break
    record    an admitted request booked in the cluster state (its prefill's queue, the decode
              load it brings), before it is dispatched

Pure: the index, the cluster state, the settings and a time in; a RouteOutcome out, and the state
booked. `on_stage(name)` is called after each stage (the bench times them); nothing here reads a
clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from common.decide import admission, policy
from common.decide.admission import AdmissionSettings, DecodeLoads, Verdict
from common.decide.cluster_state import ClusterState, Routed
from common.decide.index import PrefixIndex
from common.decide.perf import Profile
from common.decide.policy import ClusterSnapshot, Decision, NoInstances, PolicySettings, RequestInfo

RECOVERY_RETRY_S = 5.0  # Retry-After while the only instance of a kind is being restarted
STAGES = ("prefix", "snapshot", "decide", "judge", "record")


@dataclass(frozen=True, slots=True)
class ToRoute:
    """What a route needs of a request."""

    request_id: str
    keys: Sequence[int]  # the block keys of its reusable prefix (every full block but the last token's)
    prompt_tokens: int
    max_tokens: int
    expected_tokens: int = 0  # the client's hint of its output length (0: none)
    attempt: int = 0  # > 0: a later attempt of a request admitted at its arrival (its instance was lost)
    avoid: tuple[str, ...] = ()  # instances its failed attempts used: others first
    reply_subject: str = ""
    needs_prefix: bool = True  # False: the policy needs no prefix lengths (random), so none are matched


@dataclass(frozen=True, slots=True)
class RouteOutcome:
    """200: admitted (`decision` says where; it is booked); else the status to answer, why, and when to retry."""

    status: int
    reason: str
    retry_after_s: float = 0.0
    decision: Decision | None = None
    verdict: Verdict | None = None
    snapshot: ClusterSnapshot | None = None
    stages: tuple[str, ...] = ()  # the prefill instances it was booked on (several: a pipeline)

    @property
    def admitted(self) -> bool:
        return self.status == 200


def route(request: ToRoute, index: PrefixIndex | None, state: ClusterState, now: float, settings: PolicySettings,
          admit: AdmissionSettings, perf: Profile, draw: float, queued: Mapping[str, int] | None = None,
          holders: Mapping[str, int] | None = None,
          stages_of: Callable[[Decision, ClusterSnapshot, int], tuple[str, ...] | None] | None = None,
          on_stage: Callable[[str], None] | None = None) -> RouteOutcome:
    """Route one request (see the module's docstring). `holders` given: the prefix lengths as
    another index answered them (a conductor asking the cache index); else matched in `index`.
    `queued`: bytes already queued at each holder's sender (default: the cluster state's).
    `stages_of(decision, snapshot, prompt_tokens)`: the prefill instances of a pipelined prefill,
    or None to run it on p* alone."""
    mark = on_stage or _nothing
    if holders is None:
        holders = {}
        if index is not None and request.needs_prefix and request.keys:
            match = index.match(request.keys)
            holders = {node: m.prefix_len for node, m in match.per_node.items() if m.prefix_len}
    mark("prefix")
    snapshot = ClusterSnapshot(now, state.prefill_candidates(now, request.avoid),
                               state.decode_candidates(now, request.avoid), holders,
                               state.sender_queued_bytes() if queued is None else queued, draw)
    mark("snapshot")
    too_big = beyond_capacity(state, request.prompt_tokens, request.max_tokens)
    if too_big:
        mark("decide")
        return RouteOutcome(400, too_big, snapshot=snapshot)
    info = RequestInfo(request.request_id, request.prompt_tokens, len(request.keys),
                       request.prompt_tokens + request.max_tokens)
    settings = state.policy_settings(settings)  # with the balancing threshold learned so far
    decision = policy.decide(info, snapshot, settings, perf)
    loads = DecodeLoads(now, tuple([d.instance_id for d in snapshot.decode]), state.decode_load)
    if isinstance(decision, NoInstances) and decision.overloaded:
        decision = wait_for_room(info, snapshot, loads, settings, admit, perf) or decision
    mark("decide")
    if isinstance(decision, NoInstances):
        return _no_route(decision, snapshot, loads, state, request.prompt_tokens, admit)
    verdict, decision = admission.judge(decision, request.prompt_tokens, loads, admit, perf, settings.colocate,
                                        resumed=request.attempt > 0, ttft_margin=state.ttft_margin.value)
    mark("judge")
    if not verdict.admit:
        return RouteOutcome(429, f"rejected at arrival: {verdict.reason}", verdict.retry_after_s, decision, verdict,
                            snapshot)
    stages = (stages_of(decision, snapshot, request.prompt_tokens) if stages_of is not None else None) \
        or (decision.prefill_id,)
    pull = decision.pull
    state.route(Routed(request.request_id, stages, decision.decode_id, request.reply_subject, request.prompt_tokens,
                       now, decision.prefill_s + decision.transfer_s, decision.ttft_s,
                       pull.source_node if pull else "", pull.nbytes if pull else 0, request.attempt,
                       joins_decode=request.max_tokens > 1, max_tokens=request.max_tokens,
                       expected_tokens=request.expected_tokens))
    mark("record")
    return RouteOutcome(200, verdict.reason, 0.0, decision, verdict, snapshot, stages)


def beyond_capacity(state: ClusterState, prompt_tokens: int, max_tokens: int) -> str:
    """Why no decode instance could ever hold this request's KV (prompt and every token it may
    generate), or "" (a 400: waiting would not help). Unknown capacities count as room."""
    largest = state.largest_decode_room()
    need = prompt_tokens + max_tokens
    if largest is not None and need > largest:
        return (f"the request needs {need} KV tokens ({prompt_tokens} prompt + {max_tokens} max_tokens); the largest "
                f"decode instance holds {largest}: lower max_tokens or shorten the prompt")
    return ""


def wait_for_room(info: RequestInfo, snapshot: ClusterSnapshot, loads: DecodeLoads, settings: PolicySettings,
                  admit: AdmissionSettings, perf: Profile) -> Decision | None:
    """The route to a decode instance whose KV room frees, as its requests leave, within the
    TTFT SLO (the request waits in its queue); None when none's does. `loads`: the snapshot's
    decode instances', in its order."""
    horizon = admit.ttft_slo_s
    later = admission.room_within(snapshot.decode, loads.every(), loads.now, horizon)
    decision = policy.decide(info, replace(snapshot, decode=later), settings, perf)
    if isinstance(decision, NoInstances):
        return None
    return replace(decision, reason=f"{decision.reason}; waits on {decision.decode_id} for KV room, "
                                    f"freed as its requests leave within {horizon:g}s")


def _no_route(decision: NoInstances, snapshot: ClusterSnapshot, loads: DecodeLoads, state: ClusterState,
              prompt_tokens: int, admit: AdmissionSettings) -> RouteOutcome:
    now = loads.now
    if decision.overloaded:  # instances exist, their KV room is taken: an overload, not an outage
        retry = admission.kv_retry_after(prompt_tokens, snapshot.decode, loads.every(), now, admit)
        return RouteOutcome(429, f"rejected at arrival: {decision.reason}", retry, snapshot=snapshot)
    if decision.role and state.recovering(decision.role, now):  # lost capacity, coming back
        return RouteOutcome(429, f"rejected at arrival: {decision.reason} while one is being restarted",
                            RECOVERY_RETRY_S, snapshot=snapshot)
    return RouteOutcome(503, f"{decision.reason} is available", 1.0, snapshot=snapshot)


def _nothing(_stage: str) -> None:
    return None
