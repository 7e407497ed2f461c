"""Files a dumped process tree has open for writing, and what a restore does when they grew.

CRIU records the size of every regular file a process has open and refuses to restore one whose
size changed since ("bad size"), unless it is open ``O_APPEND``. A training script's own log does
exactly that. pccheck's policy: at the dump (CRIU's ``post-dump`` action, the tree still frozen)
this file is run as a script and records each such file's path and size in
``pccheck-files.json`` beside the image; before a restore, a file that grew keeps its first
``size`` bytes and the rest is set aside, never lost, as ``FILE.pcc-after-<step>``; the restored
process then writes on from where it was. A file that shrank or vanished cannot be put back: the
restore is refused, naming it.

As a script this module uses the standard library only (it runs inside the freeze: no pccheck,
no site packages).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

__all__ = ["RECORD", "open_for_writing", "prepare_files", "action_script", "tree_pids"]

RECORD = "pccheck-files.json"


def tree_pids(root: int) -> list[int]:
    """``root`` and every descendant (from /proc)."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return pids


def open_for_writing(root: int) -> dict[str, int]:
    """{path: size} of the regular files the tree rooted at ``root`` holds open for writing,
    not ``O_APPEND``."""
    out: dict[str, int] = {}
    for pid in tree_pids(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                flags = next(int(ln.split()[1], 8) for ln in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
                             if ln.startswith("flags:"))
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except (OSError, StopIteration, ValueError):
                continue
            writing = (flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
            if target.startswith("/") and not target.endswith(" (deleted)") and writing \
                    and not flags & os.O_APPEND and os.path.isfile(target) and os.stat(target).st_ino == st.st_ino:
                out[target] = st.st_size
    return out


class FileProblem(Exception):
    """A file the image needs cannot be put back as it was."""


def prepare_files(record: dict[str, int], step: int) -> list[tuple[str, str]]:
    """Before a restore: every recorded file that grew keeps its dumped size and the rest goes
    to ``FILE.pcc-after-<step>``; returns [(file, where its later bytes went)]. FileProblem for
    a file that is missing or shorter than at the dump (nothing is changed then)."""
    for path, size in record.items():
        try:
            now = os.stat(path).st_size
        except OSError as exc:
            raise FileProblem(f"{path}, open for writing at the dump, is gone ({exc.strerror}); put it back "
                              f"(at least its first {size} bytes), then resume again") from None
        if now < size:
            raise FileProblem(f"{path} has {now} bytes, fewer than the {size} it had at the dump (it was "
                              "truncated or replaced); put its bytes back, then resume again")
    moved = []
    for path, size in record.items():
        if os.stat(path).st_size == size:
            continue
        aside = f"{path}.pcc-after-{step}"
        n = 0
        while os.path.exists(aside):
            n += 1
            aside = f"{path}.pcc-after-{step}.{n}"
        with open(path, "r+b") as f, open(aside, "xb") as out:
            f.seek(size)
            while chunk := f.read(1 << 20):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())  # Invariant: the later bytes are durable before they are cut off
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
        moved.append((path, aside))
    return moved


def action_script(directory: Path) -> Path:
    """Writes the shell script CRIU runs at each action (``--action-script``) into ``directory``;
    at ``post-dump`` it runs this file with the same Python, isolated."""
    script = directory / "pccheck-criu-action.sh"
    script.write_text("#!/bin/sh\n"
                      '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
                      f'exec "{sys.executable}" -I -S "{Path(__file__).resolve()}"\n')
    script.chmod(0o755)
    return script


if __name__ == "__main__":  # CRIU's post-dump action: the tree is frozen, the image written
    files = open_for_writing(int(os.environ["CRTOOLS_INIT_PID"]))
    with open(os.path.join(os.environ["CRTOOLS_IMAGE_DIR"], RECORD), "w") as f:
        json.dump(files, f)
