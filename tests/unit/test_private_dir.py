"""Where the cluster keeps its files: a directory no other user can enter or swap."""

import os
import stat
from pathlib import Path

import pytest

from common.security import UnsafeDirectory, private_dir


def test_the_cluster_keeps_its_files_in_a_directory_no_other_user_can_enter_or_swap(tmp_path):
    made = private_dir(tmp_path / "shm" / "node-0")  # made, parents too, this user's alone
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(made.parent).st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    assert stat.S_IMODE(os.stat(private_dir(loose)).st_mode) == 0o700  # this user's own: tightened
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        private_dir(link)
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    with pytest.raises(UnsafeDirectory, match="without the sticky bit"):
        private_dir(open_to_all / "inside")
    os.chmod(open_to_all, 0o1777)  # as /dev/shm and /tmp are
    assert private_dir(open_to_all / "inside").is_dir()


def test_a_directory_another_user_made_first_is_refused_and_says_whose_it_is(tmp_path):
    if os.getuid() == 0:  # root hands one to another user; anyone else finds root's
        theirs, owner = tmp_path / "theirs", 65534
        theirs.mkdir()
        os.chown(theirs, owner, owner)
    else:
        theirs, owner = Path("/"), 0
    with pytest.raises(UnsafeDirectory, match=f"belongs to uid {owner}"):
        private_dir(theirs)
    if owner:
        with pytest.raises(UnsafeDirectory, match=f"which belongs to uid {owner}"):
            private_dir(theirs / "inside")
