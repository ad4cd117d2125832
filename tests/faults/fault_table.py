"""The fault x operation x outcome table of docs/reliability.md.

``python -m tests.faults.fault_table`` (from the repository root, as root or a user who may mount
FUSE) runs every cell of the storage-error matrix (tests/faults/storage_errors.py) through the fault
filesystem and prints the table of what each cell did; it exits 1 when that differs from what
tests/faults/test_storage_errors.py asserts (:func:`expected_table`, which the docs must hold)."""

from __future__ import annotations

import sys
import tempfile

from tests.faults.storage_errors import ERRNOS, EXPECTED, KNOWN, OPS

_WHERE = {
    "open": "creating iteration 2's rank file",
    "write": "writing it",
    "fsync": "fsyncing it",
    "rename": "renaming iteration 2's manifest into place (the commit)",
    "mkdir": "making `iter_0000002`",
    "unlink": "retention deleting iteration 1 (`keep_last=1`)",
}


def render(cells: dict) -> str:
    """Markdown: one row per operation, its errnos grouped by outcome."""
    rows = ["| operation | the call that fails | errno | outcome |", "|---|---|---|---|"]
    for op in OPS:
        groups: dict[str, list[str]] = {}
        for err in ERRNOS:
            groups.setdefault(cells[(err, op)], []).append(err)
        for outcome, errs in groups.items():
            errs_text = "each" if len(errs) == len(ERRNOS) else ", ".join(errs)
            rows.append(f"| {op} | {_WHERE[op]} | {errs_text} | {outcome} |")
    return "\n".join(rows) + "\n"


def expected_table() -> str:
    """The table as the tests assert it: item 2's outcome, or a known shortfall's."""
    return render({(e, op): (KNOWN[op][1] if op in KNOWN else EXPECTED[op]) for e in ERRNOS for op in OPS})


def main() -> int:
    from tests.faults.storage_errors import run_cell, summarize
    from tests.fusefs.control import FaultFS

    cells = {}
    for err in ERRNOS:
        for op in OPS:
            with tempfile.TemporaryDirectory(prefix="dsm-fault-table-") as d:
                with FaultFS(f"{d}/source", f"{d}/mount") as fs:
                    cells[(err, op)] = summarize(run_cell(fs, err, op), err, op)
            print(f"{err} {op}: {cells[(err, op)]}", file=sys.stderr)
    table = render(cells)
    sys.stdout.write(table)
    return 0 if table == expected_table() else 1


if __name__ == "__main__":
    sys.exit(main())
