"""Nothing a cluster process writes is readable by other users: every service runs under
common.runner.run, which sets an owner-only umask before anything is created. Here a process
started the same way creates what the services create (the SSD tier's LMDB, a request's KV file,
a handoff file written layer by layer, a log) and the modes are checked."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVICE_LIKE = """
import sys, torch
from pathlib import Path
from common import kvfiles, runner
from common.engine.layerwise import FileSink
from services.messenger.ssd import SsdStore

async def main(stop):
    out = Path(sys.argv[1])
    store = SsdStore(str(out / "ssd" / "node-a"), 1 << 20)
    store.close()
    kvfiles.write(out / "shm", "node-a", "out-r-a0.kv", torch.zeros(2, 2, 1, 4, 4))
    sink = FileSink(out / "shm" / "in-d0__r-a0.kv", (2, 2, 1, 4, 4))
    for layer in range(2):
        sink.write_layer(layer, 0, torch.zeros(2, 1, 4, 4))
    sink.finish()
    (out / "service.log").write_text("a line")
    return True

runner.run(main)
"""


def test_what_a_service_writes_is_its_owners_alone(tmp_path):
    done = subprocess.run([sys.executable, "-c", SERVICE_LIKE, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    made = [p for p in tmp_path.rglob("*")]
    assert len([p for p in made if p.is_file()]) >= 5  # data.mdb, lock.mdb, two KV files, the log
    for path in made:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, f"{path.relative_to(tmp_path)} is {oct(mode)}"


def test_a_log_kept_from_before_with_looser_modes_is_tightened(tmp_path):
    """`moonbus up` on a home an older build left: its logs folder and log files become the owner's alone."""
    from common.security import private_dir
    from tools.moonbus.cluster.processes import open_log

    logs = tmp_path / "logs"
    logs.mkdir(mode=0o755)
    old = logs / "decode-0.log"
    old.write_text("an older line\n")
    old.chmod(0o644)
    private_dir(logs)
    with open_log(old) as log:
        log.write(b"a new line\n")
    with open_log(logs / "gateway.log") as log:
        log.write(b"a first line\n")
    assert old.read_text() == "an older line\na new line\n"  # appended, not truncated
    for path in (logs, old, logs / "gateway.log"):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, f"{path.name} is {oct(mode)}"


def test_a_private_file_rewritten_over_one_with_looser_modes_is_tightened(tmp_path):
    from common.security import write_private

    kept = tmp_path / "profile.json"
    kept.write_text("{}")
    kept.chmod(0o644)
    write_private(kept, b'{"new": 1}')
    assert kept.read_bytes() == b'{"new": 1}'
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
