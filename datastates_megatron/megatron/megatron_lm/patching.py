"""Apply, check or revert the ``--lazy-ckpt`` source patch on a Megatron-LM tree.

``datastates-ckpt patch DIR`` and ``scripts/apply_patches.sh DIR`` both run :func:`main`. The patch
files are package data (``patches/``), so an installed wheel carries them; which one a tree gets is
decided by :mod:`.versions` from ``megatron/core/package_info.py``.

The patch is applied with ``git apply`` run inside the tree with ``GIT_CEILING_DIRECTORIES`` set to
its parent: from a subdirectory of another repository a plain ``git apply`` silently skips every
path. A checkout's own ``.git`` is still used (only the work tree changes, nothing is staged); a
plain copy without ``.git`` works too. ``--check`` never changes anything; applying twice or
reverting an unpatched tree is a no-op that says so.

Exit status: 0 done (or nothing to do), 1 the patch does not apply (git's reasons are printed),
2 usage error, not a Megatron-LM tree, or an untested version.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

from . import versions

__all__ = [
    "EXIT_DOES_NOT_APPLY",
    "EXIT_OK",
    "EXIT_USAGE",
    "PATCHED_FILES",
    "add_arguments",
    "main",
    "patch_path",
    "run",
]

EXIT_OK, EXIT_DOES_NOT_APPLY, EXIT_USAGE = 0, 1, 2
_HOOK = "without patching, start the script with `-m datastates_megatron.megatron.megatron_lm.run` (the runtime hook)"
# every file the patch changes references datastates_megatron: guards against a git apply that
# exits 0 but changed nothing
PATCHED_FILES = (
    "megatron/training/arguments.py",
    "megatron/training/checkpointing.py",
    "megatron/training/async_utils.py",
)


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def patch_path(name: str) -> Path:
    """The packaged patch file ``name`` (a real file: the package is installed unzipped)."""
    return Path(str(resources.files(__package__).joinpath("patches", name)))


def _git_apply(tree: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    return subprocess.run(
        ["git", "apply", *flags, str(patch)], cwd=tree, env=env, capture_output=True, text=True, check=False
    )


def _verify(tree: Path, present: bool) -> None:
    for rel in PATCHED_FILES:
        has = "datastates_megatron" in (tree / rel).read_text()
        if has != present:
            what = "was not patched" if present else "still references datastates_megatron after revert"
            raise _Refused(EXIT_DOES_NOT_APPLY, f"{rel} {what}")


def run(tree_arg: str, mode: str = "apply", *, allow_untested: bool = False) -> tuple[int, str]:
    """Apply (``mode="apply"``), check (``"check"``) or revert (``"revert"``) the patch on the tree.

    Returns ``(exit status, what happened)``; the message of a non-zero status is an error.
    """
    try:
        return EXIT_OK, _run(tree_arg, mode, allow_untested)
    except _Refused as e:
        return e.status, str(e)


def _run(tree_arg: str, mode: str, allow_untested: bool) -> str:
    if shutil.which("git") is None:
        raise _Refused(EXIT_USAGE, "git is required (the patch is applied with git apply)")
    tree = Path(tree_arg)
    if not tree.is_dir():
        raise _Refused(EXIT_USAGE, f"{tree_arg} is not a directory")
    tree = tree.resolve()
    info = tree / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise _Refused(
            EXIT_USAGE,
            f"{info} not found: is {tree} a Megatron-LM checkout? (tested versions: {versions.tested_names()})",
        )
    try:
        version = versions.read_version(info)
        row = versions.resolve(version, allow=allow_untested or None, override="--allow-untested")
    except versions.UntestedVersionError as e:
        raise _Refused(
            EXIT_USAGE, f"{e} (read from {info}); {_HOOK}, with {versions.ALLOW_UNTESTED_ENV}=1 for an untested version"
        ) from e
    except (ValueError, OSError) as e:
        raise _Refused(EXIT_USAGE, f"{e} (read from {info})") from e
    patch = patch_path(row.patch)
    if not patch.is_file():
        raise _Refused(EXIT_USAGE, f"{patch} is missing (a broken install?)")
    tag = f"Megatron-LM {version} at {tree} ({row.patch})"

    def reasons(*flags: str) -> str:
        return _git_apply(tree, patch, *flags).stderr.strip()

    applied = _git_apply(tree, patch, "--reverse", "--check").returncode == 0
    applies = not applied and _git_apply(tree, patch, "--check").returncode == 0
    if mode == "check":
        if applied:
            return f"already applied: {tag}"
        if applies:
            return f"applies cleanly: {tag}"
        raise _Refused(EXIT_DOES_NOT_APPLY, f"{row.patch} does not apply to {tag}:\n{reasons('--check')}")
    if mode == "apply":
        if applied:
            return f"already applied: {tag}"
        if not applies:
            raise _Refused(
                EXIT_DOES_NOT_APPLY,
                f"{row.patch} does not apply to {tag} (locally modified files? {_HOOK}):\n{reasons('--check')}",
            )
        res = _git_apply(tree, patch)
        if res.returncode != 0:
            raise _Refused(EXIT_DOES_NOT_APPLY, f"git apply {row.patch} failed on {tag}:\n{res.stderr.strip()}")
        _verify(tree, present=True)
        return f"applied: {tag}"
    if not applied:
        if applies:
            return f"not applied: {tag}"
        raise _Refused(
            EXIT_DOES_NOT_APPLY,
            f"cannot revert {row.patch} from {tag}: the patched files were modified:\n{reasons('--reverse', '--check')}",
        )
    res = _git_apply(tree, patch, "--reverse")
    if res.returncode != 0:
        raise _Refused(EXIT_DOES_NOT_APPLY, f"git apply --reverse {row.patch} failed on {tag}:\n{res.stderr.strip()}")
    _verify(tree, present=False)
    return f"reverted: {tag}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("megatron_dir", metavar="MEGATRON_DIR", help="a Megatron-LM checkout or unpacked copy")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only say whether it applies or is applied")
    mode.add_argument("--revert", action="store_true", help="undo the patch")
    p.add_argument(
        "--allow-untested",
        action="store_true",
        help=f"patch a version that is not tested but of a tested MAJOR.MINOR series with that series' "
        f"patch (as {versions.ALLOW_UNTESTED_ENV}=1)",
    )


def main(args: argparse.Namespace) -> int:
    """Run the parsed ``patch`` command; prints what happened (errors on stderr), returns the status."""
    mode = "check" if args.check else "revert" if args.revert else "apply"
    status, message = run(args.megatron_dir, mode, allow_untested=args.allow_untested)
    if status == EXIT_OK:
        print(message)
    else:
        print(f"error: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="apply_patches.sh",
        description="Apply, check or revert the datastates-megatron --lazy-ckpt patch on a Megatron-LM tree.",
    )
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
