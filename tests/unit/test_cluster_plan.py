"""The processes a local cluster starts come from one plan: each is started once, under the name,
node and kind the plan gives it, and the closed bus's users are made from the same plan."""

from types import SimpleNamespace

import pytest

from tools.moonbus.cluster.processes import Cluster, ClusterSpec


def started(spec: ClusterSpec, monkeypatch) -> list[tuple[str, str, str, list[str]]]:
    """(name, kind, node, argv) of every process start_services spawns, none of them run."""
    spawned = []

    def spawn(self, name, kind, argv, node="", restarts=None):
        spawned.append((name, kind, node, argv))
        self.procs[name] = SimpleNamespace()

    monkeypatch.setattr(Cluster, "spawn", spawn)
    Cluster(spec).start_services()
    return spawned


@pytest.mark.parametrize("shape", [{}, {"prefill": 2, "decode": 3, "conductors": 3, "gateways": 2, "cache_indexes": 2},
                                   {"coupled": 2}])
def test_every_process_is_started_once_as_the_plan_names_it(shape, monkeypatch, tmp_path):
    spec = ClusterSpec(home=tmp_path, auth=False, **shape)
    cluster = Cluster(spec)
    plan = cluster.plan()
    spawned = started(spec, monkeypatch)
    assert [(name, kind, node) for name, kind, node, _ in spawned] == [(p.name, p.kind, p.node) for p in plan]
    assert len({p.name for p in plan}) == len(plan)
    for (name, kind, _, argv), p in zip(spawned, plan):
        assert argv[argv.index("-m") + 1] == f"services.{kind}" and argv[argv.index("--instance-id") + 1] == name
        if kind in ("messenger", "prefill", "decode", "coupled"):
            assert argv[argv.index("--node") + 1] == p.node
        if kind == "gateway":
            assert argv[argv.index("--port") + 1] == str(spec.port + p.index)
    # each worker shares its node with that node's messenger, and only with it
    nodes = {}
    for p in plan:
        if p.node:
            nodes.setdefault(p.node, []).append(p.kind)
    assert all(kinds[0] == "messenger" and len(kinds) == 2 for kinds in nodes.values())


def test_the_closed_bus_gives_a_user_to_every_planned_process_that_speaks_for_instances(tmp_path):
    cluster = Cluster(ClusterSpec(home=tmp_path, auth=False, prefill=2, coupled=0, cache_indexes=2))
    users = cluster.planned_instances()
    assert users["prefill-1"] == ("prefill", ("prefill-1",), ())
    assert users["messenger-p1"] == ("messenger", ("messenger-p1",), ("node-p1",))
    assert users["cache_index-1"][1] == ("cache-index-1",)
    assert users["gateway"] == ("gateway", ("gateway",), ())  # its tenants' usage only under its own name
    assert "conductor" not in users
    coupled = Cluster(ClusterSpec(home=tmp_path, auth=False, coupled=1)).planned_instances()
    assert coupled["coupled-0"] == ("coupled", ("coupled-0-prefill", "coupled-0-decode"), ())


@pytest.mark.parametrize("shape, sharing", [({"decode": 3}, 3), ({"decode": 1, "max_decode": 4}, 4), ({"coupled": 2}, 2)])
def test_the_decode_instances_of_a_machine_share_its_default_kv_room(shape, sharing, monkeypatch, tmp_path):
    """Each decode (or coupled) instance is told how many may run at once (an autoscaled cluster's
    most), and its default KV room is that share: 3 instances no longer hold 3 x 25% of the memory."""
    from services.decode import config as decode_config

    spec = ClusterSpec(home=tmp_path, auth=False, **shape)
    argvs = [argv for _, kind, _, argv in started(spec, monkeypatch) if kind in ("decode", "coupled")]
    assert argvs and all(argv[argv.index("--kv-instances") + 1] == str(sharing) for argv in argvs)
    args = decode_config.load(["--node", "node-d0", "--kv-instances", str(sharing)])
    assert args.kv_cache_bytes == decode_config.default_kv_cache_bytes() // sharing
    assert decode_config.load(["--node", "node-d0", "--kv-instances", "4", "--kv-cache-bytes", "1000"]).kv_cache_bytes == 1000
