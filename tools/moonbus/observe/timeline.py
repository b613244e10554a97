"""One request's time, stage by stage, beside what the conductor predicted for it (from its events).

    stage         actual                                   predicted (the `routed` event)
    route         received -> routed                       -
    queue         prefilled.queued_s (waited at prefill)   routed.queue_s
    prefill       prefilled.seconds (prefix load, compute)  routed.prefill_s + routed.transfer_s
    handoff tail  kv_transferred.tail_s                    -
    decode wait   decode_joined.waited_s (KV room, batch)  -
    ttft          first_token.ttft_s                       first_token.predicted_ttft_s (routed.ttft_s)
    decode        decode_finished.seconds over its tokens  routed.predicted_tbt_s per token

Only the first attempt's prediction is set beside the actual of that attempt; a resumed request
shows each attempt's rows. Pure: event dicts in ({"kind", "ts", "data"}), rows out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    attempt: int
    name: str
    actual_s: float | None
    predicted_s: float | None = None
    note: str = ""

    @property
    def error(self) -> float | None:
        """actual / predicted (1 = exact)."""
        if self.actual_s is None or not self.predicted_s:
            return None
        return self.actual_s / self.predicted_s


def stages(events: list[dict]) -> list[Stage]:
    """The request's stages, per attempt, in the order they happen."""
    events = sorted(events, key=lambda e: e.get("ts", 0.0))
    received = next((e["ts"] for e in events if e["kind"] == "received"), None)
    out: list[Stage] = []
    for attempt in sorted({e.get("data", {}).get("attempt", 0) for e in events if e["kind"] != "received"}):
        mine = {e["kind"]: e for e in events if e.get("data", {}).get("attempt", 0) == attempt}
        routed = mine.get("routed", {}).get("data", {})
        if "routed" in mine and received is not None and attempt == 0:
            out.append(Stage(attempt, "route", mine["routed"]["ts"] - received))
        if "prefilled" in mine:
            p = mine["prefilled"]["data"]
            out.append(Stage(attempt, "queue", p.get("queued_s"), routed.get("queue_s")))
            predicted = (routed.get("prefill_s") or 0.0) + (routed.get("transfer_s") or 0.0) if routed else None
            out.append(Stage(attempt, "prefill", p.get("seconds"), predicted,
                             f"{p.get('cached_tokens', 0)} of {p.get('prompt_tokens', 0)} prompt tokens reused"))
        if "kv_transferred" in mine:
            t = mine["kv_transferred"]["data"]
            out.append(Stage(attempt, "handoff tail", t.get("tail_s"), None,
                             f"{t.get('bytes', 0)} bytes {t.get('src_node', '?')} -> {t.get('dest_node', '?')} "
                             f"over {t.get('transport', '?')}"))
        if "decode_joined" in mine:
            j = mine["decode_joined"]["data"]
            out.append(Stage(attempt, "decode wait", j.get("waited_s"), None, f"joined a batch of {j.get('batch')}"))
        if "first_token" in mine:
            f = mine["first_token"]["data"]
            out.append(Stage(attempt, "ttft", f.get("ttft_s"), f.get("predicted_ttft_s") or routed.get("ttft_s")))
        if "decode_finished" in mine:
            d = mine["decode_finished"]["data"]
            tokens = max(1, int(d.get("tokens", 1)) - 1)
            per_token = d["seconds"] / tokens if d.get("seconds") is not None else None
            out.append(Stage(attempt, "decode per token", per_token, routed.get("predicted_tbt_s") or None,
                             f"{d.get('tokens')} tokens, {d.get('finish_reason')}"))
    return out


def format_stages(rows: list[Stage]) -> str:
    lines = [f"{'attempt':>7} {'stage':<17} {'actual':>10} {'predicted':>10} {'x':>6}  note"]
    for s in rows:
        actual = "-" if s.actual_s is None else f"{s.actual_s:.4f}s"
        predicted = "-" if s.predicted_s is None else f"{s.predicted_s:.4f}s"
        error = "" if s.error is None else f"{s.error:.2f}"
        lines.append(f"{s.attempt:>7} {s.name:<17} {actual:>10} {predicted:>10} {error:>6}  {s.note}")
    return "\n".join(lines)
