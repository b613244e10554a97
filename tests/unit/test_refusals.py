"""How often a refused KV-link connection is logged and audited (common/transport/refusals.py)."""

from common.transport.refusals import Refusals, source_of


def test_a_source_is_a_network_not_an_address():
    assert source_of("127.0.0.2") == source_of("127.44.9.1") == "127.0.0.0/8"  # the whole loopback range
    assert source_of("10.1.2.3") == source_of("10.1.2.200") == "10.1.2.0/24"
    assert source_of("10.1.3.3") != source_of("10.1.2.3")
    assert source_of("2001:db8::1") == source_of("2001:db8::ffff:1") == "2001:db8::/64"
    assert source_of("::ffff:10.1.2.3") == "10.1.2.0/24"  # an IPv4-mapped address counts as its IPv4
    assert source_of("not-an-address") == "not-an-address"


def test_two_thousand_loopback_addresses_make_one_line_per_window():
    refusals = Refusals(window_s=10.0, cap=20)
    told = [refusals.refused(f"127.{i // 250}.{i % 250}.1", now=i * 0.001) for i in range(2000)]
    assert sum(t is not None for t in told) == 1
    later = refusals.refused("127.0.0.9", now=10.5)
    assert later is not None and later.untold == 1999 and later.source == "127.0.0.0/8"


def test_a_flood_from_many_networks_is_capped_per_window_and_counted():
    refusals = Refusals(window_s=10.0, cap=20)
    told = [refusals.refused(f"2001:db8:{i:x}::1", now=i * 0.001) for i in range(2000)]  # 2,000 /64s
    assert sum(t is not None for t in told) == 20
    nxt = refusals.refused("2001:db8:ffff::1", now=10.5)  # the next window's first line carries the rest
    assert nxt is not None and nxt.untold_elsewhere == 1980
    again = refusals.refused("2001:db8:fffe::1", now=10.6)
    assert again is not None and again.untold_elsewhere == 0
