"""A failed attempt's next (common/decide/retry.py): a migration or a re-dispatch, and the
instances it keeps away from (only the one that failed)."""

from common.decide.retry import after_failure, excused, spent


def test_the_next_attempt_avoids_only_the_instance_that_failed():
    assert after_failure("prefill", False, "p0", "d0") == after_failure("prefill", False, "p0", "")
    redispatch = after_failure("prefill", False, "p0", "d0")
    assert not redispatch.migrating and redispatch.avoid == {"p0"}  # decode may hold nothing of it: keep it
    lost = after_failure("decode_lost", False, "p0", "d0")
    assert lost.migrating and lost.avoid == {"d0"}  # p0 may hold the prompt's prefix: go back to it
    started = after_failure("decode", True, "p0", "d0")
    assert started.migrating and started.avoid == {"d0"}
    transfer = after_failure("transfer", False, "p0", "d0")
    assert transfer.migrating and transfer.avoid == {"p0", "d0"}  # the KV could not travel between them


def test_each_kind_of_retry_has_its_own_limit():
    migration, redispatch = after_failure("decode", True, "p0", "d0"), after_failure("prefill", False, "p0", "d0")
    assert spent(migration, migrations=3, redispatches=0, max_migrations=3, prefill_retries=2)
    assert not spent(redispatch, migrations=3, redispatches=1, max_migrations=3, prefill_retries=2)
    assert spent(redispatch, migrations=0, redispatches=2, max_migrations=3, prefill_retries=2)


def test_a_failure_on_instances_already_found_gone_is_excused_once():
    redispatch = after_failure("prefill", False, "p0", "d0")
    assert excused(redispatch, {"p0"}) and excused(redispatch, {"p0", "d0"})
    assert not excused(redispatch, set()) and not excused(redispatch, {"d0"})
    transfer = after_failure("transfer", False, "p0", "d0")  # both failed: both must have been found gone
    assert not excused(transfer, {"p0"}) and excused(transfer, {"p0", "d0"})
    assert not excused(after_failure("prefill", False, "", ""), set())  # nothing named: nothing to excuse
