"""What a request's next attempt is after one failed: a migration or a re-dispatch, and which
instances it keeps away from.

After the first token, or when its KV could not reach the decode node or its decode instance was
lost, it is a migration (the prefill instance did its part); otherwise a re-dispatch of a prefill
that failed. It goes elsewhere first, if there is an elsewhere, away from the instance that
failed: the decode instance after the first token or when it was lost, the prefill instance
before, both when the KV could not travel between them. The other may well hold what the new
attempt reuses (the prompt's prefix), so it is not avoided.

One death is counted once. A gateway that finds an instance gone itself (no responder to its
probe) resumes the request at once, and the conductor, not having heard of the exit yet, may send
the next attempt to the same dead instance, then hand it back for that exit: the same death seen
a second time. An instance found gone at a counted failure excuses one later failure of it
(`excused`); an excused failure's finding excuses nothing, so a request that kills every instance
it reaches (a poison request) still spends its limit, in at most twice the failures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet


@dataclass(frozen=True)
class Retry:
    migrating: bool  # counts against the migration limit, not the re-dispatch limit
    avoid: frozenset[str]  # instances the next attempt is routed away from


def after_failure(stage: str, started: bool, prefill_id: str, decode_id: str) -> Retry:
    """The next attempt of a request whose attempt failed at `stage` (a TokenChunk's stage:
    'transfer', 'decode_lost', ...), `started` if the client has tokens already."""
    migrating = started or stage in ("transfer", "decode_lost")
    if stage == "transfer":
        failed = (prefill_id, decode_id)
    elif migrating:
        failed = (decode_id,)
    else:
        failed = (prefill_id,)
    return Retry(migrating, frozenset(i for i in failed if i))


def spent(retry: Retry, migrations: int, redispatches: int, max_migrations: int, prefill_retries: int) -> bool:
    """Whether the request may not try again: its limit of that kind of retry is used up."""
    return migrations >= max_migrations if retry.migrating else redispatches >= prefill_retries


def excused(retry: Retry, found_gone: AbstractSet[str]) -> bool:
    """Whether this failure is one already counted: every instance it failed on was found gone
    (and that failure counted) before this attempt was routed. The caller takes them out of
    `found_gone`: each finding excuses one failure."""
    return bool(retry.avoid) and retry.avoid <= found_gone
