"""A service that opens KV links refuses to start without the cluster secret, unless told
--insecure, and says why: without the secret its links would take any peer's bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import security
from services.coupled import config as coupled_config
from services.messenger import config as messenger_config
from services.prefill import config as prefill_config

ROOT = Path(__file__).resolve().parents[2]
LOADERS = {"messenger": messenger_config.load, "prefill": prefill_config.load, "coupled": coupled_config.load}


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("MOONBUS_CLUSTER_SECRET_FILE", "MOONBUS_INSECURE")}


@pytest.mark.parametrize("kind", ["messenger", "prefill", "coupled"])
def test_without_a_secret_the_process_refuses_to_start_and_says_why(kind, tmp_path):
    done = subprocess.run([sys.executable, "-m", f"services.{kind}", "--nats-url", "nats://127.0.0.1:9",
                           "--model", "tiny-random", "--home", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=clean_env())
    assert done.returncode != 0
    assert "refusing to start" in done.stderr and "--cluster-secret-file" in done.stderr and "--insecure" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("kind", ["messenger", "prefill", "coupled"])
def test_a_secret_or_an_explicit_insecure_is_accepted(kind, tmp_path, monkeypatch):
    for name in ("MOONBUS_CLUSTER_SECRET_FILE", "MOONBUS_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    secret = security.new_secret_file(tmp_path / "cluster.key")
    base = ["--model", "tiny-random", "--home", str(tmp_path)]
    with_secret = LOADERS[kind]([*base, "--cluster-secret-file", str(secret)])
    insecure = LOADERS[kind]([*base, "--insecure"])
    for cfg in (with_secret, insecure):
        cfg = getattr(cfg, "prefill", cfg)  # a coupled instance's links are its prefill role's
        assert cfg.insecure == (cfg is getattr(insecure, "prefill", insecure))
