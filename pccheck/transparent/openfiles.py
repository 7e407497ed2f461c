"""Files a dumped process tree has open for writing, and what a restore does when they grew.

CRIU records the size of every regular file a process has open and refuses to restore one whose
size changed since ("bad size"), unless it is open ``O_WRONLY | O_APPEND``. A training script's own log does
exactly that. pccheck's policy: at the dump (CRIU's ``post-dump`` action, the tree still frozen)
this file is run as a script and records each such file's path, size and whether the process may write it in
``pccheck-files.json`` beside the image (every regular file it has open but those ``O_WRONLY |
O_APPEND``, which CRIU reopens as they are); before a restore, a file the process writes that
grew keeps its first ``size`` bytes and the rest is set aside, never lost, as
``FILE.pcc-after-<step>``; the restored process then writes on from where it was. A file that
shrank or vanished, or that the process only reads and that grew, is named and the restore
refused.

As a script this module uses the standard library only (it runs inside the freeze: no pccheck,
no site packages).
"""

from __future__ import annotations

import json
import os
import shlex
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


def open_for_writing(root: int) -> dict[str, list[int]]:
    """{path: [size, writing]} of the regular files the tree rooted at ``root`` holds open whose
    size CRIU checks at restore: all but those open ``O_WRONLY | O_APPEND`` (``writing``: 1 if
    some descriptor may write it)."""
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
            mode = flags & os.O_ACCMODE
            exempt = mode == os.O_WRONLY and flags & os.O_APPEND  # CRIU reopens these as they are
            if target.startswith("/") and not target.endswith(" (deleted)") and not exempt \
                    and os.path.isfile(target) and os.stat(target).st_ino == st.st_ino:
                writing = int(mode in (os.O_WRONLY, os.O_RDWR))
                out[target] = [st.st_size, max(writing, out.get(target, [0, 0])[1])]
    return out


class FileProblem(Exception):
    """A file the image needs cannot be put back as it was."""


def prepare_files(record: dict[str, list[int]], step: int) -> list[tuple[str, str]]:
    """Before a restore: every recorded file the process writes that grew keeps its dumped size
    and the rest goes to ``FILE.pcc-after-<step>`` (same owner and mode); returns [(file, where
    its later bytes went)]. FileProblem, with nothing changed, for a file that is missing, shorter
    than at the dump, or only read by the process and grown since (it is not the process's to cut)."""
    for path, (size, writing) in record.items():
        try:
            now = os.stat(path).st_size
        except OSError as exc:
            raise FileProblem(f"{path}, open for writing at the dump, is gone ({exc.strerror}); put it back "
                              f"(at least its first {size} bytes), then resume again") from None
        if now < size:
            raise FileProblem(f"{path} has {now} bytes, fewer than the {size} it had at the dump (it was "
                              "truncated or replaced); put its bytes back, then resume again")
        if now > size and not writing:
            raise FileProblem(f"{path}, which the process only reads, grew from {size} to {now} bytes since "
                              "the dump, and CRIU restores only the size it had; pccheck does not cut a file "
                              "the process does not write: put back its first version, then resume again")
    moved = []
    for path, (size, _) in record.items():
        st = os.stat(path)
        if st.st_size == size:
            continue
        aside = f"{path}.pcc-after-{step}"
        n = 0
        while os.path.exists(aside):
            n += 1
            aside = f"{path}.pcc-after-{step}.{n}"
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, st.st_mode & 0o7777)
        with open(path, "r+b") as f, os.fdopen(fd, "wb") as out:
            os.fchown(out.fileno(), st.st_uid, st.st_gid)
            f.seek(size)
            while chunk := f.read(1 << 20):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())  # Invariant: the later bytes are durable before they are cut off
            _fsync_dir(os.path.dirname(aside))
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
        moved.append((path, aside))
    return moved


def _fsync_dir(d: str) -> None:
    fd = os.open(d or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def action_script(directory: Path) -> Path:
    """Writes the shell script CRIU runs at each action (``--action-script``) into ``directory``;
    at ``post-dump`` it runs this file with the same Python, isolated."""
    script = directory / "pccheck-criu-action.sh"
    script.write_text("#!/bin/sh\n"
                      '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
                      f"exec {shlex.quote(sys.executable)} -I -S {shlex.quote(str(Path(__file__).resolve()))}\n")
    script.chmod(0o755)
    return script


if __name__ == "__main__":  # CRIU's post-dump action: the tree is frozen, the image written
    files = open_for_writing(int(os.environ["CRTOOLS_INIT_PID"]))
    with open(os.path.join(os.environ["CRTOOLS_IMAGE_DIR"], RECORD), "w") as f:
        json.dump(files, f)
