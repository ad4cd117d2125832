"""The fault x operation x outcome table of docs/reliability.md.

``python -m tests.faults.fault_table`` (from the repository root, as root or a user who may mount
FUSE) runs every cell of the storage-error matrix (tests/faults/storage_errors.py) through the fault
filesystem, then the restore's read faults, and prints the table of what each cell did; it exits 1 when that differs from what
tests/faults/test_storage_errors.py asserts (:func:`expected_table`, which the docs must hold)."""

from __future__ import annotations

import sys
import tempfile

from tests.faults.storage_errors import ERRNOS, EXPECTED, EXPECTED_READ, KNOWN, OPS, READ_FAULTS

_WHERE = {
    "open": "creating iteration 2's rank file",
    "write": "writing it",
    "fsync": "fsyncing it",
    "rename": "renaming iteration 2's manifest into place (the commit)",
    "mkdir": "making `iter_0000002`",
    "unlink": "retention deleting iteration 1 (`keep_last=1`)",
}


_READ_WHERE = "reading iteration 2's rank file at restore (`load()` of the newest)"


def render(cells: dict, read_cells: dict) -> str:
    """Markdown: one row per operation, its errnos grouped by outcome; then the restore's reads
    (``read_cells``: fault -> outcome; ``hold``: the read never returns until let go)."""
    rows = ["| operation | the call that fails | errno | outcome |", "|---|---|---|---|"]
    for op in OPS:
        groups: dict[str, list[str]] = {}
        for err in ERRNOS:
            groups.setdefault(cells[(err, op)], []).append(err)
        for outcome, errs in groups.items():
            errs_text = "each" if len(errs) == len(ERRNOS) else ", ".join(errs)
            rows.append(f"| {op} | {_WHERE[op]} | {errs_text} | {outcome} |")
    groups = {}
    for fault in READ_FAULTS:
        groups.setdefault(read_cells[fault], []).append("held (never returns)" if fault == "hold" else fault)
    for outcome, faults in groups.items():
        rows.append(f"| read | {_READ_WHERE} | {', '.join(faults)} | {outcome} |")
    return "\n".join(rows) + "\n"


def expected_table() -> str:
    """The table as the tests assert it: item 2's outcome, or a known shortfall's."""
    return render(
        {(e, op): (KNOWN[op][1] if op in KNOWN else EXPECTED[op]) for e in ERRNOS for op in OPS}, EXPECTED_READ
    )


def main() -> int:
    from tests.faults.storage_errors import run_cell, run_read_cell, summarize, summarize_read
    from tests.fusefs.control import FaultFS

    cells = {}
    for err in ERRNOS:
        for op in OPS:
            with tempfile.TemporaryDirectory(prefix="dsm-fault-table-") as d:
                with FaultFS(f"{d}/source", f"{d}/mount") as fs:
                    cells[(err, op)] = summarize(run_cell(fs, err, op), err, op)
            print(f"{err} {op}: {cells[(err, op)]}", file=sys.stderr)
    read_cells = {}
    for fault in READ_FAULTS:
        with tempfile.TemporaryDirectory(prefix="dsm-fault-table-") as d:
            with FaultFS(f"{d}/source", f"{d}/mount") as fs:
                read_cells[fault] = summarize_read(run_read_cell(fs, fault, f"{d}/writer"), fault)
        print(f"{fault} read: {read_cells[fault]}", file=sys.stderr)
    table = render(cells, read_cells)
    sys.stdout.write(table)
    return 0 if table == expected_table() else 1


if __name__ == "__main__":
    sys.exit(main())
