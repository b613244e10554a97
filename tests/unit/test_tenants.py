"""API keys, tenants, their cache namespaces (services/gateway/tenants.py) and their limits and fair
shares (common/decide/tenancy.py)."""

import json

import pytest

from common.kv.blocks import DEFAULT_SEED, block_keys
from common.security import hash_key
from common.decide.tenancy import Tenant, TenantLimits
from services.gateway.tenants import KeyBook, KeyFileError, cache_seed, parse_key_file


def key_file(tmp_path, *entries):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": list(entries)}))
    return path


def test_a_key_names_its_tenant_and_only_its_hash_is_stored(tmp_path):
    path = key_file(tmp_path, {"hash": hash_key("mb-secret-a"), "tenant": "acme", "max_concurrent": 2})
    book = KeyBook(str(path))
    assert "mb-secret-a" not in path.read_text()
    assert book.tenant_of("Bearer mb-secret-a") == Tenant("acme", 2, None, False)
    assert book.tenant_of("Bearer mb-secret-b") is None
    assert book.tenant_of(None) is None and book.tenant_of("Basic xyz") is None
    assert KeyBook("").tenant_of(None).name == "default"  # open gateway


def test_the_key_file_is_reread_when_it_changes(tmp_path):
    import os

    path = key_file(tmp_path, {"hash": hash_key("old"), "tenant": "acme"})
    book = KeyBook(str(path))
    assert book.tenant_of("Bearer old").name == "acme"
    path.write_text(json.dumps({"keys": [{"hash": hash_key("new"), "tenant": "acme"}]}))
    os.utime(path, (1e9, 1e9))  # a different mtime, whatever the clock's resolution
    assert book.tenant_of("Bearer old") is None and book.tenant_of("Bearer new").name == "acme"


@pytest.mark.parametrize("entry", [{"hash": "abc", "tenant": "x"}, {"tenant": "x"},
                                   {"hash": "a" * 64, "tenant": "x", "max_concurrent": 0}])
def test_a_malformed_key_file_is_refused(entry):
    with pytest.raises(KeyFileError):
        parse_key_file(json.dumps({"keys": [entry]}))


def test_requests_in_flight_are_limited_per_tenant():
    limits, acme = TenantLimits(), Tenant("acme", max_concurrent=2)
    first, _, _ = limits.admit(acme, 10, now=0.0)
    second, _, _ = limits.admit(acme, 10, now=0.0)
    third, why, retry = limits.admit(acme, 10, now=0.0)
    assert first and second and third is None and "2 requests in flight" in why and retry == 1.0
    assert limits.admit(Tenant("other", max_concurrent=2), 10, now=0.0)[0] is not None  # another tenant
    limits.release(acme, first, 10)
    assert limits.admit(acme, 10, now=0.0)[0] is not None


def test_tokens_per_minute_book_at_admission_and_correct_at_the_end():
    limits, acme = TenantLimits(), Tenant("acme", tokens_per_minute=1000)
    a, _, _ = limits.admit(acme, 600, now=0.0)  # prompt + max_tokens
    refused, why, retry = limits.admit(acme, 600, now=10.0)
    assert refused is None and "used 600 of its 1000" in why and retry == 50.0  # a's booking expires at 60 s
    limits.release(acme, a, 150)  # it used 150 (prompt + completion)
    assert limits.admit(acme, 600, now=11.0)[0] is not None
    assert limits.admit(acme, 600, now=72.0)[0] is not None  # the window moved on
    assert "may use 1000 per minute" in limits.admit(acme, 5000, now=200.0)[1]


def test_limits_hold_over_every_gateway_replica_and_forget_a_silent_one():
    one, two = TenantLimits(), TenantLimits()
    acme = Tenant("acme", max_concurrent=2, tokens_per_minute=1000)
    assert one.admit(acme, 300, now=0.0)[0] is not None
    assert two.admit(acme, 300, now=0.0)[0] is not None
    two.heard("gateway-0", one.usage(0.0), now=0.0)
    assert one.usage(0.0) == {"acme": [1, 300]}
    refused, why, _ = two.admit(acme, 300, now=0.5)  # one here, one at the other gateway
    assert refused is None and "2 requests in flight" in why
    assert two.precheck(acme, 0.5)[0]
    # tokens too: 300 here and 300 there of 1000, so 500 more do not fit
    wide = Tenant("acme", tokens_per_minute=1000)
    assert "used 600 of its 1000" in two.admit(wide, 500, now=0.5)[1]
    # a gateway not heard from for PEER_TTL_S holds nothing (it may have died)
    assert two.admit(acme, 300, now=0.5 + TenantLimits.PEER_TTL_S + 0.1)[0] is not None


def test_a_tenant_without_limits_gets_a_fair_share_while_others_are_served():
    """Reproduced: a tenant without limits (moonbus keys add's default) held 38 streams and another
    tenant waited 79 s. Alone it may hold any number; with others served, an equal share."""
    limits = TenantLimits(fair_floor=4)
    hog, other = Tenant("hog"), Tenant("other")
    for i in range(38):  # alone: no share to keep to
        assert limits.admit(hog, 10, now=0.0)[0] is not None, i
    booking, why, _ = limits.admit(other, 10, now=0.0)  # the other tenant is admitted at once
    assert booking is not None and not why
    refused, why, retry = limits.admit(hog, 10, now=0.0)  # 38 of 39 held: over half
    assert refused is None and "fair share while 2 tenants" in why and retry == 1.0
    assert limits.precheck(hog, now=0.0)[0]  # refused before its prompt is tokenized too
    for _ in range(3):
        assert limits.admit(other, 10, now=0.0)[0] is not None  # below the floor: never refused
    for _ in range(35):  # the hog's requests end: 3 held, below the floor again
        limits.release(hog, [0.0, 10], 10)
    assert limits.admit(hog, 10, now=0.0)[0] is not None
    # the share counts the tenants of every gateway replica: 4 and 4 held at the first gateway
    elsewhere = TenantLimits(fair_floor=4)
    elsewhere.heard("gateway-0", limits.usage(0.0), now=0.0)
    assert "fair share while 2 tenants" in elsewhere.admit(hog, 10, now=0.1)[1]
    # a key's own --max-concurrent replaces the share; a floor of 0 turns it off
    assert limits.admit(Tenant("hog", max_concurrent=100), 10, now=0.0)[0] is not None
    off = TenantLimits(fair_floor=0)
    off.admit(other, 10, now=0.0)
    assert all(off.admit(hog, 10, now=0.0)[0] is not None for _ in range(50))


def test_a_tenant_at_its_limits_is_refused_before_its_prompt_is_tokenized():
    limits = TenantLimits()
    busy, spent = Tenant("busy", max_concurrent=1), Tenant("spent", tokens_per_minute=100)
    assert limits.precheck(busy, now=0.0) == ("", 0.0)
    limits.admit(busy, 10, now=0.0)
    why, retry = limits.precheck(busy, now=0.0)
    assert "1 requests in flight" in why and retry == 1.0
    limits.admit(spent, 100, now=0.0)
    why, retry = limits.precheck(spent, now=30.0)
    assert "used its 100 tokens per minute" in why and retry == 30.0
    assert limits.precheck(spent, now=61.0) == ("", 0.0)  # the window moved on
    assert limits.precheck(Tenant("free"), now=0.0) == ("", 0.0)


def test_equal_prompts_of_two_tenants_never_share_a_block_even_under_the_same_salt():
    prompt = list(range(64))
    a, b, c, d = Tenant("a"), Tenant("b"), Tenant("c", shared_cache=True), Tenant("d", shared_cache=True)
    keys = {name: block_keys(prompt, 16, seed) for name, seed in [
        ("a", cache_seed(a, None)), ("b", cache_seed(b, None)), ("open", cache_seed(None, None)),
        ("salt-a", cache_seed(a, "sys-prompt-v1")), ("salt-b", cache_seed(b, "sys-prompt-v1")),
        ("salt-c", cache_seed(c, "sys-prompt-v1")), ("salt-d", cache_seed(d, "sys-prompt-v1")),
        ("shared", cache_seed(c, None))]}
    assert not set(keys["a"]) & set(keys["b"])
    assert not set(keys["salt-a"]) & set(keys["salt-b"])  # a salt is scoped to its tenant: guessing it gains nothing
    assert not set(keys["salt-c"]) & set(keys["salt-d"])  # shared_cache shares the common namespace, not salts
    assert keys["salt-a"] == block_keys(prompt, 16, cache_seed(Tenant("a"), "sys-prompt-v1"))  # its own salt: shared
    assert not set(keys["salt-a"]) & set(keys["a"])
    assert keys["open"] == keys["shared"] == block_keys(prompt, 16, DEFAULT_SEED)


def test_a_salt_still_parts_the_callers_of_an_open_gateway_and_no_name_borrows_anothers():
    open_gateway = KeyBook("").tenant_of(None)
    seeds = {cache_seed(open_gateway, "v1"), cache_seed(open_gateway, "v2"), cache_seed(open_gateway, None)}
    assert len(seeds) == 3
    assert cache_seed(open_gateway, "v1") == cache_seed(None, "v1")
    # a tenant's name may hold ":": "a" salting "b:c" must not land in the namespace of "a:b" salting "c"
    assert cache_seed(Tenant("a"), "b:c") != cache_seed(Tenant("a:b"), "c")


@pytest.mark.parametrize("tenants", [
    {"acme": [-1000, 0]},  # a negative count once let a tenant limited to 1 run 4 on each gateway
    {"acme": []},  # an empty list once made both gateways answer 500 (IndexError)
    {"acme": [1]},
    {f"t{i}": [1, 1] for i in range(5000)},  # past USAGE_TENANTS_MAX: 30,000 of them grew each gateway by 300 MB
])
def test_a_gateways_usage_that_is_not_two_counts_per_tenant_is_refused_on_the_wire(tenants):
    from schemas.codec import WireError
    from schemas.tokens import TenantUsage

    raw = json.dumps({"gateway_id": "gateway-9", "tenants": tenants}).encode()
    with pytest.raises(WireError):
        TenantUsage.from_bytes(raw)


def test_the_gateways_heard_are_bounded_and_a_silent_one_makes_room():
    limits = TenantLimits()
    for i in range(TenantLimits.PEERS_MAX):
        assert limits.heard(f"gateway-{i}", {"acme": [1, 10]}, now=0.0)
    assert not limits.heard("gateway-new", {"acme": [1, 10]}, now=1.0)  # all the others still speak
    assert limits.heard("gateway-0", {"acme": [2, 10]}, now=1.0)  # one already heard: updated
    assert limits.heard("gateway-new", {"acme": [1, 10]}, now=0.0 + TenantLimits.PEER_TTL_S + 2.0)  # the rest fell silent
