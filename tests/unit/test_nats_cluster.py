"""A NATS cluster from the services' side: every server in one flag, each server's cluster block."""

import json

import pytest

from common import bus
from tools.moonbus.cluster.security import ClusterSecrets, NatsRoutes, nats_config


def test_comma_separated_urls_name_every_server():
    assert bus.server_urls("nats://a:4222, nats://b:4222,") == ["nats://a:4222", "nats://b:4222"]
    assert bus.server_urls("nats://a:4222") == ["nats://a:4222"]
    with pytest.raises(ValueError):
        bus.server_urls(" , ")


def test_a_cluster_server_has_authenticated_routes_and_the_same_users(tmp_path):
    secrets = ClusterSecrets.create(tmp_path / "secrets")
    routes = NatsRoutes("moonbus", "10.0.0.11", 6222, ("nats://10.0.0.12:6222",), "pw")
    config = json.loads(nats_config(secrets, "10.0.0.11", 4222, tmp_path / "js", "nats-a", routes=routes))
    assert config["cluster"] == {"name": "moonbus", "host": "10.0.0.11", "port": 6222,
                                 "authorization": {"user": "route", "password": "pw"},
                                 "routes": ["nats://route:pw@10.0.0.12:6222"]}
    single = json.loads(nats_config(secrets, "10.0.0.11", 4222, tmp_path / "js", "nats-a"))
    assert "cluster" not in single and single["authorization"] == config["authorization"]
