"""``datastates-ckpt``: list, inspect and verify checkpoints, export one to another format, patch a
Megatron-LM tree, and say where the package's data is.  Its ``--help`` is the reference.

One module per command (:mod:`.ls`, :mod:`.inspect`, :mod:`.verify`, :mod:`.export`, :mod:`.where`,
:mod:`.patch`), each with a ``run(args)``; the parser in :mod:`.parser`; what they share in
:mod:`.common` and :mod:`.reading`.  Layering: ``ls``, ``inspect`` and ``verify`` read checkpoints
through ``engine`` only (the tier's survey, the manifest, the reader's ``open_rank``), import no
megatron and never write.  ``export`` hands over to :mod:`..megatron.export` (imported only then;
``--format torch_dist`` runs a Megatron-LM checkout), which writes only under OUT_DIR.  ``patch``,
``where`` and ``--version`` need the stdlib only.  Each read-only command gathers a plain dict (the
``--json`` document, stable keys) and renders it as text otherwise.  The gathering functions are
public and raise ``NoCheckpointError`` (path missing / not a checkpoint), ``CorruptCheckpointError``
(damaged manifest) or ``CliUsageError``; :func:`main` turns those into one line on stderr and an
exit status.
"""

from __future__ import annotations

import os
import sys

from .._deps import DIST, RUNTIME, MissingDependencyError, require
from ..engine.errors import CheckpointError, FormatVersionError, NoCheckpointError, OptionsError
from ..engine.names import TRACKER_NAME as _TRACKER_NAME  # noqa: F401  (the tracker the help names: test_cli)
from . import export, inspect, ls, patch, verify, where
from .common import EXIT_DAMAGED, EXIT_NEWER, EXIT_OK, EXIT_USAGE, PROG, CliUsageError
from .inspect import inspect_checkpoint
from .ls import list_checkpoints
from .parser import build_parser
from .verify import verify_checkpoint
from .where import package_data

__all__ = [
    "main",
    "list_checkpoints",
    "inspect_checkpoint",
    "verify_checkpoint",
    "package_data",
    "CliUsageError",
    "EXIT_OK",
    "EXIT_DAMAGED",
    "EXIT_USAGE",
    "EXIT_NEWER",
]

_RUN = {"ls": ls.run, "inspect": inspect.run, "verify": verify.run, "where": where.run, "patch": patch.run}
_STDLIB_ONLY = {"where", "patch"}  # run without the runtime dependencies (a login node: patching needs Python only)
_EXIT_NO_RUNTIME = 1  # a runtime dependency is missing (the help's "exit status")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``datastates-ckpt`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = None
    if "--" in argv:  # export's training flags: split off before argparse, which mangles them
        at = argv.index("--")
        argv, flags = argv[:at], argv[at + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    if flags is not None and args.command != "export":
        parser.error(f"{args.command} takes no arguments after --")
    if args.command not in _STDLIB_ONLY:
        try:
            require(RUNTIME, DIST)
        except MissingDependencyError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return _EXIT_NO_RUNTIME
    try:
        if args.command == "export":
            return export.run(args, flags or [])
        return _RUN[args.command](args)
    except BrokenPipeError:  # `| head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except MissingDependencyError as e:  # an optional one the command needs (export: megatron-core, psutil)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        if isinstance(e, FormatVersionError):
            return EXIT_NEWER
        usage = isinstance(e, (NoCheckpointError, CliUsageError, OptionsError)) or not isinstance(e, CheckpointError)
        return EXIT_USAGE if usage else EXIT_DAMAGED
    except Exception as e:  # a case no check foresaw: still one line, never a traceback (unless asked)
        if os.environ.get("DSM_DEBUG"):
            raise
        print(
            f"{PROG}: error: unexpected {type(e).__name__}: {e} (a damaged checkpoint or a bug in {PROG};"
            " DSM_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_DAMAGED
