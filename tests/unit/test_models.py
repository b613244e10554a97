"""Where models come from: the machine's converted copy of SmolLM2, taken by a new home instead of
converting again (the conversion itself runs in tests/integration/test_real_model.py); a process
that only reads the model store waiting for the one that prepares it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common import models
from tests import required
from tests.wait import until_sync

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def machine_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONBUS_MODEL_CACHE", str(tmp_path / "machine"))
    return tmp_path


def test_a_new_home_takes_the_machines_converted_copy(machine_cache):
    kept = models.machine_copy()
    assert kept is not None and kept.parent == machine_cache / "machine"
    assert f"-v{models.BUILD_VERSION}-" in kept.name  # a new conversion recipe is a new copy
    converted = machine_cache / "converted"  # what a conversion left in some other home
    converted.mkdir()
    (converted / "config.json").write_text("{}")
    (converted / "model.safetensors").write_bytes(b"weights")
    models._keep_machine_copy(converted)
    assert (kept / "model.safetensors").read_bytes() == b"weights"

    ref = models.prepare(models.SMOLLM2, machine_cache / "home")  # no conversion: taken from the copy
    assert ref.path == models.resolve(models.SMOLLM2, machine_cache / "home").path
    assert (ref.path / "model.safetensors").read_bytes() == b"weights"
    assert os.stat(ref.path / "model.safetensors").st_ino == os.stat(kept / "model.safetensors").st_ino  # linked


def test_a_prepared_model_is_its_owners_alone_whatever_the_umask(machine_cache):
    """A copy kept by a process with a common umask (022: a test, a bench) is linked into a new
    home: what the home ends up with is owner-only all the same, and so is the copy's."""
    converted = machine_cache / "converted"
    (converted / "sub").mkdir(parents=True, mode=0o755)
    (converted / "config.json").write_text("{}")
    (converted / "sub" / "tokenizer.json").write_text("{}")
    for path in (converted / "config.json", converted / "sub" / "tokenizer.json"):
        path.chmod(0o644)
    models._keep_machine_copy(converted)
    home = machine_cache / "home"
    ref = models.prepare(models.SMOLLM2, home)
    made = [home, *home.rglob("*")]  # the home too: prepare made it
    assert any(p.name == "tokenizer.json" for p in made)
    for path in made:
        assert path.stat().st_mode & 0o077 == 0, f"{path} is {oct(path.stat().st_mode)}"
    assert (models.machine_copy() / "sub" / "tokenizer.json").stat().st_mode & 0o077 == 0  # the same inode
    assert ref.path.is_dir()


def test_an_empty_model_cache_setting_keeps_no_machine_copy(machine_cache, monkeypatch):
    monkeypatch.setenv("MOONBUS_MODEL_CACHE", "")
    assert models.machine_copy() is None
    assert not models._take_machine_copy(machine_cache / "out")


def _read_only(home: Path, command: str) -> list[str]:
    """`command` run in a private mount namespace where `home` is a read-only bind mount (as every
    container but compose's model-init mounts the model store); the test still writes `home`."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        required.missing("mounts", "a read-only bind mount in a private mount namespace needs root, unshare(1) "
                                   "and mount(8)")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        required.missing("mounts", f"unshare -m: {probe.stderr.strip()}")
    return ["unshare", "-m", "sh", "-c",
            f"mount --bind {home} {home} && mount -o remount,bind,ro {home} && exec {command}"]


@contextlib.contextmanager
def _waiting_for_the_model(home: Path, command: str):
    """`command` started where `home` is read-only, handed over once it says it waits for the
    model: (the process, its stderr lines, every one read by the time the block has ended)."""
    proc = subprocess.Popen(_read_only(home, command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    said: list[str] = []  # (its stderr is this reader's alone: communicate() would race it for the lines)
    reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        until_sync(lambda: any("waiting up to" in line for line in said) or proc.poll() is not None,
                   "it says it waits for the model", timeout_s=300)
        assert proc.poll() is None, "".join(said)  # it waits; it did not fail on the read-only store
        yield proc, said
    finally:
        proc.kill()
        reader.join(timeout=60)


def test_a_process_that_only_reads_the_model_store_waits_for_the_model_to_appear(tmp_path):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    code = ("import logging; from pathlib import Path; from common import models; logging.basicConfig(level=logging.INFO); "
            f"ref = models.prepare({models.TINY_RANDOM!r}, Path({str(home)!r}), models.MODEL_WAIT_S); "
            "print(f'{ref.name}: {ref.path}')")  # as a service prepares it
    with _waiting_for_the_model(home, f"{sys.executable} -c \"{code}\"") as (proc, said):
        ref = models.prepare(models.TINY_RANDOM, home)  # the preparer (model-init), where the store is writable
        proc.wait(timeout=300)
    assert proc.returncode == 0, "".join(said)
    assert proc.stdout.read().strip() == f"{ref.name}: {ref.path}"
    assert any("is there now" in line for line in said)


def test_a_service_stopped_while_it_waits_for_the_model_exits_at_once(tmp_path):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    script = tmp_path / "wait.py"
    script.write_text("import asyncio, logging, signal; from pathlib import Path; from common import models; "
                      "logging.basicConfig(level=logging.INFO)\n"
                      "async def main():\n"
                      "    stop = asyncio.Event()\n"
                      "    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)\n"
                      f"    print(await models.prepare_for_service({models.TINY_RANDOM!r}, Path({str(home)!r}), stop))\n"
                      "asyncio.run(main())")  # as a service waits, and hears its SIGTERM
    with _waiting_for_the_model(home, f"{sys.executable} {script}") as (proc, said):
        proc.send_signal(signal.SIGTERM)
        # well before MODEL_WAIT_S: asyncio.run's end joins its executor's threads, so it exits only
        # once the waiting thread has ended
        proc.wait(timeout=300)
    assert proc.returncode == 0, "".join(said)
    assert proc.stdout.read().split() == ["None"]  # no model: the service returns
    assert not any((home / "models").iterdir())


def test_a_command_that_cannot_write_the_model_store_fails_at_once_saying_where_to_prepare_it(tmp_path):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    done = subprocess.run(_read_only(home, f"{sys.executable} -m common.models {models.TINY_RANDOM} --home {home}"),
                          capture_output=True, text=True, cwd=REPO, timeout=300)  # no wait outside the services
    assert done.returncode != 0
    assert "ModelNotFound" in done.stderr and "python -m common.models tiny-random" in done.stderr, done.stderr
    assert not any((home / "models").iterdir())  # it wrote nothing there
