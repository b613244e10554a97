"""The pure parts of tools/compose_e2e: the build context's filter, the host diff, the base image key."""

from __future__ import annotations

from pathlib import Path

from tools.compose_e2e import images
from tools.compose_e2e.host import HostState


def make_tree(root: Path, files: list[str], dockerignore: str) -> None:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    (root / ".dockerignore").write_text(dockerignore)


def test_context_files_follow_dockerignore_like_the_docker_cli(tmp_path: Path) -> None:
    make_tree(tmp_path, [
        "pyproject.toml", "common/a.py", "common/__pycache__/a.pyc", "deep/x/__pycache__/b.pyc",
        ".venv/bin/python", "moonbus.egg-info/PKG-INFO", "docs/a.md", "docs/keep.md", "build/out",
    ], ".venv\n**/__pycache__\n*.egg-info\n# a comment\n\ndocs\n!docs/keep.md\n/build\n")
    names = [name for _, name in images.context_files(tmp_path)]
    assert names == [".dockerignore", "pyproject.toml", "common/a.py", "docs/keep.md"]


def test_host_differences_name_what_docker_changed_and_ignore_other_interfaces() -> None:
    before = HostState(iptables={"ipv4": ""}, sysctls={"/proc/sys/net/ipv4/ip_forward": "0"},
                       links=("eth0", "lo"), mounts=(), paths=())
    now = HostState(iptables={"ipv4": "*filter\n:FORWARD DROP [0:0]\nCOMMIT"},
                    sysctls={"/proc/sys/net/ipv4/ip_forward": "1"},
                    links=("br-0123456789ab", "docker0", "eth0", "lo", "veth-test0"),
                    mounts=("/run/docker/netns/default",), paths=("/run/docker",))
    diffs = before.differences(now)
    assert len(diffs) == 5
    assert diffs[0].startswith("ipv4 iptables: was ''")
    assert diffs[1] == "/proc/sys/net/ipv4/ip_forward: was 0, now 1"
    assert diffs[2] == "links: added ['br-0123456789ab', 'docker0'], removed []"  # not veth-test0: not Docker's
    assert diffs[3] == "mounts: added ['/run/docker/netns/default'], removed []"
    assert diffs[4] == "paths: added ['/run/docker'], removed []"
    assert before.differences(before) == []
    assert HostState.from_json(now.to_json()) == now


def test_the_base_image_tag_is_keyed_on_its_package_list(monkeypatch) -> None:
    tag = images.local_base_tag()
    assert tag.startswith("moonbus/pybase:bookworm-") and tag == images.local_base_tag()
    monkeypatch.setattr(images, "BASE_PACKAGES", (*images.BASE_PACKAGES, "curl"))
    assert images.local_base_tag() != tag


def test_a_table_that_filters_nothing_counts_as_no_table():
    from tools.compose_e2e.host import _without_empty_tables

    empty = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]", "COMMIT"]
    dropping = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT ACCEPT [0:0]", "COMMIT"]
    ruled = ["*nat", ":PREROUTING ACCEPT [0:0]", "-A PREROUTING -j DOCKER", "COMMIT"]
    assert _without_empty_tables(empty) == []
    assert _without_empty_tables(dropping) == dropping  # Docker's FORWARD policy is a difference
    assert _without_empty_tables(empty + ruled) == ruled


def test_what_a_default_docker_engine_left_behind_is_named_as_in_the_way() -> None:
    left = HostState(iptables={"ipv4": "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\nCOMMIT"},
                     sysctls={"/proc/sys/net/bridge/bridge-nf-call-iptables": "1"})
    [why] = left.obstacles()
    assert "FORWARD policy is DROP" in why and "bridge-nf-call-iptables is 1" in why
    # either alone lets bridged frames through
    assert HostState(iptables=left.iptables, sysctls={"/proc/sys/net/bridge/bridge-nf-call-iptables": "0"}).obstacles() == []
    assert HostState(iptables={"ipv4": "*filter\n:FORWARD ACCEPT [0:0]\nCOMMIT"}, sysctls=left.sysctls).obstacles() == []


def test_a_bridge_that_was_there_before_is_recreated_as_it_was(monkeypatch) -> None:
    from tools.compose_e2e import host

    before = HostState(links=("docker0", "eth0", "lo"),
                       link_details={"docker0": {"kind": "bridge", "mtu": 1500, "up": False,
                                                 "addresses": ["172.17.0.1/16"]}})
    now = HostState(links=("eth0", "lo"))  # the test's dockerd (--bridge=none) removed it
    ran = []
    monkeypatch.setattr(host.HostState, "capture_under", classmethod(lambda cls, watched: now))
    monkeypatch.setattr(host, "_run", lambda argv: ran.append(argv) or True)
    try:
        before.restore()
    except host.HostNotRestored as exc:  # the stand-in host does not change: the comparison still says so
        assert "removed ['docker0']" in str(exc)
    assert ran == [["ip", "link", "add", "docker0", "type", "bridge"], ["ip", "link", "set", "docker0", "mtu", "1500"],
                   ["ip", "addr", "add", "172.17.0.1/16", "dev", "docker0"]]  # down before: left down
    assert "docker_gwbridge" in before.differences(HostState(links=("docker_gwbridge", "docker0", "eth0", "lo")))[0]
