"""Which commit a run's code came from. Standard library only: setup.py loads this file by path to
record the commit when it builds, before the package can be imported."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Optional


def checkout_commit(tracked_file: Path, mark_dirty: bool) -> Optional[str]:
    """Short commit of the git checkout that tracks ``tracked_file`` ("+dirty" appended, with
    ``mark_dirty``, when it has uncommitted changes); None without git or such a checkout. Asking
    for the file, not the directory, keeps a copy installed inside another repository (a venv in
    the user's project) from reporting that repository's commit."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=tracked_file.parent,
                              check=True).stdout.strip()

    try:
        git("ls-files", "--error-unmatch", tracked_file.name)
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+dirty" if mark_dirty and git("status", "--porcelain") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def source_commit(tracked_file: Path, mark_dirty: bool) -> Optional[str]:
    """The FLASHHEAD_COMMIT variable where set (the device gets a copy whose .git may be stale),
    else ``checkout_commit``."""
    given = os.environ.get("FLASHHEAD_COMMIT")
    # Recorded as the code's name in every result: a typo or a blank was recorded as given.
    if given and not re.fullmatch(r"[0-9a-fA-F]{7,40}(\+dirty)?", given):
        raise ValueError(f"FLASHHEAD_COMMIT must name a commit by its hex sha (7 to 40 digits, '+dirty' allowed), "
                         f"got {given!r}")
    return given or checkout_commit(tracked_file, mark_dirty)
