"""Where models come from: the machine's converted copy of SmolLM2, taken by a new home instead of
converting again (the conversion itself runs in tests/integration/test_real_model.py)."""

from __future__ import annotations

import os

import pytest

from common import models


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
