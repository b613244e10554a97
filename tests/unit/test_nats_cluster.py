"""A NATS cluster from the services' side: every server in one flag, each server's cluster block, and
who may speak for which instance."""

import json

import pytest

from common import bus
from schemas import subjects
from tools.moonbus.cluster.security import ClusterSecrets, NatsRoutes, instance_user, nats_config


def test_comma_separated_urls_name_every_server():
    assert bus.server_urls("nats://a:4222, nats://b:4222,") == ["nats://a:4222", "nats://b:4222"]
    assert bus.server_urls("nats://a:4222") == ["nats://a:4222"]
    with pytest.raises(ValueError):
        bus.server_urls(" , ")


def test_a_cluster_server_has_authenticated_routes_and_the_same_users(tmp_path):
    secrets = ClusterSecrets.create(tmp_path / "secrets")
    routes = NatsRoutes("moonbus", "10.0.0.11", 6222, ("nats://10.0.0.12:6222",), "pw")
    config = json.loads(nats_config(secrets, "10.0.0.11", 4222, tmp_path / "js", "nats-a", routes=routes))
    # a silent route is dropped in seconds, as a client drops a silent server (common.bus)
    assert config["cluster"] == {"name": "moonbus", "host": "10.0.0.11", "port": 6222,
                                 "ping_interval": "2s", "ping_max": 2,
                                 "authorization": {"user": "route", "password": "pw"},
                                 "routes": ["nats://route:pw@10.0.0.12:6222"]}
    single = json.loads(nats_config(secrets, "10.0.0.11", 4222, tmp_path / "js", "nats-a"))
    assert "cluster" not in single and single["authorization"] == config["authorization"]


def test_a_process_of_its_own_may_speak_only_for_its_instances(tmp_path):
    secrets = ClusterSecrets.create(tmp_path / "secrets")
    processes = {"decode-0": ("decode", ("decode-0",), ()),
                 "coupled-0": ("coupled", ("coupled-0-prefill", "coupled-0-decode"), ()),
                 "messenger-d0": ("messenger", ("messenger-d0",), ("node-d0",))}
    for name in processes:
        secrets.ensure_user(instance_user(name))
    users = {u["user"]: u for u in json.loads(nats_config(secrets, "127.0.0.1", 4222, tmp_path / "js", "n",
                                                          processes=processes))["authorization"]["users"]}
    own = users["instance-decode-0"]["permissions"]
    assert subjects.worker_heartbeat("decode", "decode-0") in own["publish"]["allow"]
    assert subjects.control_progress("decode-0") in own["publish"]["allow"]
    assert not [s for s in own["publish"]["allow"] if s.startswith("moonbus.workers.heartbeat") and s.endswith("*")]
    assert "_INBOX_instance-decode-0.>" in own["subscribe"]["allow"]
    # it reads its own tasks, probes and refusals, not another instance's
    assert {subjects.decode_tasks("decode-0"), subjects.worker_probe("decode-0"),
            subjects.control_refused("decode-0")} <= set(own["subscribe"]["allow"])
    assert not [s for s in own["subscribe"]["allow"] if s.startswith(("moonbus.decode.", "moonbus.workers.")) and "*" in s
                and not s.startswith("moonbus.workers.heartbeat.")]  # every heartbeat: the cluster's state
    assert "moonbus.messenger.node-d0.*" in users["instance-messenger-d0"]["permissions"]["subscribe"]["allow"]
    assert "moonbus.messenger.*.*" not in users["instance-messenger-d0"]["permissions"]["subscribe"]["allow"]
    coupled = users["instance-coupled-0"]["permissions"]["publish"]["allow"]
    assert {subjects.worker_heartbeat("prefill", "coupled-0-prefill"), subjects.worker_heartbeat("decode", "coupled-0-decode"),
            subjects.control_alive("coupled-0-decode")} <= set(coupled)
    # a messenger's KV events only as its own node's (a KV event claims blocks on a node)
    messenger = users["instance-messenger-d0"]["permissions"]["publish"]["allow"]
    assert "moonbus.events.kv.*.node-d0" in messenger and not [s for s in messenger if s.startswith("moonbus.events.kv") and
                                                              s != "moonbus.events.kv.*.node-d0"]
    # where each process has a user of its own, the roles' shared users are not users of the server
    assert not {"gateway", "prefill", "decode", "messenger", "cache_index", "coupled"} & set(users)
    assert {"admin", "auditor", "supervisor", "conductor"} <= set(users)
    # a role's shared user (compose: a container per instance) speaks for any instance of its role,
    # never for another role's
    users = {u["user"]: u for u in json.loads(nats_config(secrets, "0.0.0.0", 4222, tmp_path / "js", "n"))
             ["authorization"]["users"]}
    role = users["decode"]["permissions"]["publish"]["allow"]
    assert "moonbus.workers.heartbeat.decode.*" in role and not [s for s in role if ".heartbeat.prefill" in s]
    assert "moonbus.events.kv.*.*" in users["messenger"]["permissions"]["publish"]["allow"]
    assert "moonbus.workers.heartbeat.cache_index.*" in users["cache_index"]["permissions"]["publish"]["allow"]


def test_a_message_speaks_for_whom_its_subject_names():
    assert subjects.speaks_for(subjects.worker_heartbeat("decode", "decode-0"), "decode", "decode-0")
    assert not subjects.speaks_for(subjects.worker_heartbeat("decode", "decode-1"), "decode", "decode-0")
    assert not subjects.speaks_for(subjects.worker_heartbeat("cache_index", "decode-0"), "decode", "decode-0")
    assert subjects.speaks_for(subjects.control_progress("prefill-0"), "prefill-0")
    assert not subjects.speaks_for("prefill-0", "prefill-0")  # a subject is more than the claim
