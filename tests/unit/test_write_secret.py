"""``security.write_secret``, the one way secret files are written: private from their creation, whatever the
umask, never over an existing file unless told, and an overwritten file given the mode (it keeps its own
otherwise)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tinker_atropos.security import write_secret


@pytest.fixture(params=[0o022, 0o077, 0o000], ids=lambda umask: f"umask-{umask:03o}")
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_new_secret_is_this_users_only(tmp_path: Path, umask: int) -> None:
    write_secret(tmp_path / "token", "abc\n")
    write_secret(tmp_path / "tls.key", b"\x00key")
    assert (tmp_path / "token").read_text() == "abc\n" and (tmp_path / "tls.key").read_bytes() == b"\x00key"
    assert _mode(tmp_path / "token") == _mode(tmp_path / "tls.key") == 0o600
    write_secret(tmp_path / "tls.crt", b"certificate", mode=0o644)  # a certificate: public, exactly 0644
    assert _mode(tmp_path / "tls.crt") == 0o644


def test_an_existing_file_is_kept_unless_replaced_and_then_made_private(tmp_path: Path) -> None:
    path = tmp_path / "valkey.conf"
    path.write_text("an old, longer password line\n")
    path.chmod(0o644)
    with pytest.raises(FileExistsError):
        write_secret(path, "new\n")
    assert path.read_text() == "an old, longer password line\n"
    write_secret(path, "new\n", replace=True)
    assert path.read_text() == "new\n" and _mode(path) == 0o600
