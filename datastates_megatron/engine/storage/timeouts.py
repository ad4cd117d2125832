"""How long a request to an object store may go unanswered: the stated, configurable bound of every
operation (a listing, a HEAD, a GET, a part of an upload, a conditional PUT).

* ``connect_s``: to open a connection (``DSM_S3_CONNECT_TIMEOUT_S``, default 5 s);
* ``read_s``: for the first byte of an answer, and between bytes (``DSM_S3_READ_TIMEOUT_S``,
  default 10 s);
* ``deadline_s``: one request with its retries (``DSM_S3_DEADLINE_S``, default 30 s).  A try is
  started only if it can end, unanswered, before the deadline (``connect_s + read_s`` after it
  starts), so an endpoint that never answers fails the request within ``deadline_s`` -- 20 s with
  the defaults, two tries -- whatever its number of retries (:mod:`.retry`).  A transfer whose bytes
  keep flowing is not cut by the deadline: only silence is.

An argument of :class:`.s3.S3Storage` wins over the environment, which wins over the default; a
value that is not a number of seconds > 0 is refused with one line naming the variable.

Thread-safety: immutable.
"""

from __future__ import annotations

import dataclasses
import math
import os

from ..errors import OptionsError

__all__ = ["Timeouts", "ENV"]

#: field -> the environment variable that sets it
ENV = {
    "connect_s": "DSM_S3_CONNECT_TIMEOUT_S",
    "read_s": "DSM_S3_READ_TIMEOUT_S",
    "deadline_s": "DSM_S3_DEADLINE_S",
}


@dataclasses.dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0
    read_s: float = 10.0
    deadline_s: float = 30.0

    def __post_init__(self) -> None:
        bad = [
            (f, f"must be a number of seconds > 0, got {v!r}")
            for f, v in dataclasses.asdict(self).items()
            if not _ok(v)
        ]
        if bad:
            raise OptionsError("object-storage timeouts", bad)

    @property
    def try_s(self) -> float:
        """The longest one try waits with nothing answered."""
        return self.connect_s + self.read_s

    @classmethod
    def from_env(cls, environ=None, **given) -> Timeouts:
        """The timeouts ``given`` (``None``: not given), else the environment's, else the defaults."""
        environ = os.environ if environ is None else environ
        values = {}
        for field, var in ENV.items():
            if given.get(field) is not None:
                values[field] = given[field]
                continue
            text = environ.get(var, "").strip()
            if not text:
                continue
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not _ok(value):
                raise OptionsError("object-storage timeouts", [(var, f"must be a number of seconds > 0, got {text!r}")])
            values[field] = value
        return cls(**values)

    def text(self) -> str:
        """The bound, for a message: what it was and which variables change it."""
        return (
            f"no answer within {self.read_s:g} s a try, deadline {self.deadline_s:g} s; "
            f"{ENV['read_s']} and {ENV['deadline_s']} change them"
        )


def _ok(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
