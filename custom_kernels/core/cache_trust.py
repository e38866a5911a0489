"""Compiled code is loaded only from a cache that no other user can write to.

A shared object (``ctypes.CDLL``) or a cubin (the CUDA driver) taken from the cache runs with this
process's rights: whoever can write to the cache root, to a directory under it or to the file can
run code in every process that loads kernels from it. So, as sshd's ``StrictModes`` does for a
user's ``authorized_keys`` and the directories above it, nothing compiled is loaded when the file,
or any directory from the cache root down to it, is writable by group or others, or belongs to a
user other than this one and root. The refusal is ``UnsafeCacheError``, naming the path and the
fix. (Directories the library creates are private from the start: ``cache_dir.make_private_dirs``.)

A path found private is remembered for the process: only its owner (this user) or root can make it
writable again, so the loaders, which memoize what they load, stat each directory once per process
and the launch path never. A refusal is not remembered: once the permissions are fixed, the next
load in the same process passes. Off POSIX (no user ids) nothing is checked.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from custom_kernels.core.cache_dir import ENV_VAR, cache_root
from custom_kernels.core.errors import UnsafeCacheError

_private: set[str] = set()  # directories and files found private in this process
_passed: set[str] = set()  # paths as callers gave them, found private with their whole chain


def require_private(path: Path | str) -> None:
    """Raises UnsafeCacheError unless compiled code at ``path`` (an artifact, or the directory a
    build will write one to) may be loaded: see the module docstring. Parts of the chain that do
    not exist yet are skipped (a build creates them private)."""
    why = refusal(path)
    if why is not None:
        raise UnsafeCacheError(*why)


def refusal(path: Path | str) -> tuple[str, str] | None:
    """(the message, the path at fault) when compiled code at ``path`` must not be loaded, else
    None."""
    if not hasattr(os, "geteuid") or str(path) in _passed:
        return None
    root, chain = _chain(Path(os.path.realpath(path)))
    for part in chain:
        key = str(part)
        if key in _private:
            continue
        try:
            problem = _inspect(part)
        except FileNotFoundError:  # not there yet: whoever creates it, the parent is checked
            continue
        if problem is not None:
            return _message(part, problem, root), key
        _private.add(key)
    _passed.add(str(path))
    return None


def forget() -> None:
    """Forgets which paths were found private (tests)."""
    _private.clear()
    _passed.clear()


def _chain(path: Path) -> tuple[Path | None, list[Path]]:
    """(the cache root, the paths to check): the root and each directory below it down to
    ``path``, then ``path``. A path outside the root (a loader given a file of its own): its
    directory and itself."""
    root = cache_root()
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return None, [path.parent, path]
    chain = [root]
    for part in parts:
        chain.append(chain[-1] / part)
    return root, chain


def _inspect(path: Path) -> str | None:
    """What makes ``path`` unsafe ("is writable by group (drwxrwxr-x)"), or None. Raises
    FileNotFoundError when it does not exist."""
    info = os.stat(path)
    owner, me = info.st_uid, os.geteuid()
    if owner not in (me, 0):
        return f"belongs to user id {owner}, neither this user ({me}) nor root"
    writers = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH))
               if info.st_mode & bit]
    if writers:
        return f"is writable by {' and '.join(writers)} ({stat.filemode(info.st_mode)})"
    return None


def _message(part: Path, problem: str, root: Path | None) -> str:
    if problem.startswith("belongs"):
        fix = (f"have {part} removed or given to you, or set {ENV_VAR} to a directory of your "
               "own (mkdir -m 700 DIR)")
    else:
        whole = f" (`chmod -R go-w {root}` fixes the whole cache)" if root else ""
        fix = (f"run `chmod go-w {part}`{whole}, or set {ENV_VAR} to a private directory "
               "(mkdir -m 700 DIR)")
    return (f"cutlass-ops refuses to load compiled code from its cache: {part} {problem}, so "
            "another user could replace the kernels that this process would run. To fix it, "
            f"{fix}.")
