"""What every fuzz test of a reader shares: the hypothesis settings (bounded, reproducible), the per-case check
(the reader's own error with one sentence, or an accepted result equal to the valid one; never another exception,
never a hang) and the count of outcomes per reader that conftest.py prints at the end of the run.

A case is run as ``outcome(reader, call, error, expect)``: ``call()`` reads the mutated input under a per-case
alarm; ``error`` is the reader's error type; ``expect(result)`` returns None when the accepted result is the valid
one (or what the format cannot tell apart from it by design: bytes inside tensor data, padding), OTHER_VALID (see
there) and otherwise a sentence saying how it differs. Anything but a clean error or an equal result fails the test.
"""

from __future__ import annotations

import os
import signal
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

CASE_SECONDS = 10  # far above any reader's time on a 2-core machine; a FIFO read would block forever
ERROR, EQUAL, OTHER = "clean error", "accepted-equal", "other"
# expect() returns OTHER_VALID for an input that is valid by every rule the reader can check without more context,
# and so read as it says, though not as the case asked for (a pack header rewritten for another range)
OTHER_VALID = "accepted-other"
OUTCOMES: dict[str, Counter] = defaultdict(Counter)  # reader -> outcome -> cases


def fuzz(examples: int):
    """Hypothesis settings of a fuzz test: `examples` cases, derandomized (CI replays the same cases), no example
    database, no deadline (timing is not the property; the per-case alarm catches hangs)."""
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


class Hang(Exception):
    pass


@contextmanager
def alarm(seconds: float = CASE_SECONDS):
    """Raise Hang in the main thread when the block runs longer than `seconds` (interrupts a blocked open/read)."""
    def ring(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def one_sentence(msg: str) -> str | None:
    """Why `msg` is not one sentence for a user, or None."""
    if not msg.strip():
        return "the message is empty"
    if "\n" in msg or "Traceback" in msg:
        return "the message spans lines"
    if len(msg) > 700:
        return f"the message has {len(msg)} characters"
    return None


def outcome(reader: str, call: Callable, error: type[BaseException] | tuple,
            expect: Callable[[object], str | None], names: str | None = None, valid: bool = False) -> str:
    """Run one case and count it; AssertionError (after counting) unless it is a clean error or an equal result.
    `names`: text the error message must contain (the file or the setting); `valid`: the input is valid, so an
    error is a failure too."""
    try:
        with alarm():
            result = call()
    except error as exc:
        msg = str(exc)
        why = one_sentence(msg) or (None if names is None or names in msg else f"the message does not name {names}")
        why = why or ("a valid input was refused" if valid else None)
        if why is None:
            OUTCOMES[reader][ERROR] += 1
            return ERROR
        OUTCOMES[reader][OTHER] += 1
        raise AssertionError(f"{reader}: {why}: {msg!r}") from None
    except Exception as exc:  # noqa: BLE001 - the property under test: nothing else may come out
        OUTCOMES[reader][OTHER] += 1
        raise AssertionError(f"{reader}: {type(exc).__name__} instead of the reader's error: {exc}") from exc
    differs = expect(result)
    if differs is None or differs == OTHER_VALID:
        kind = EQUAL if differs is None else OTHER_VALID
        OUTCOMES[reader][kind] += 1
        return kind
    OUTCOMES[reader][OTHER] += 1
    raise AssertionError(f"{reader}: accepted, but {differs}")


def equal_or(a, b, what: str) -> str | None:
    return None if a == b else f"{what} differs: {a!r:.200} vs {b!r:.200}"


# ------------------------------------------------------------------------------------------------ inputs
def flip(data: bytes, pos: int, bit: int) -> bytes:
    return data[:pos] + bytes([data[pos] ^ (1 << bit)]) + data[pos + 1:]


def byte_mutations(data: bytes, hot: int) -> st.SearchStrategy[tuple[str, int, bytes]]:
    """(kind, position, mutated bytes): bit flips anywhere and (as often) in the first `hot` bytes (the header),
    truncation, bytes appended, bytes overwritten. position: the first changed byte (len(data) when appended)."""
    n = len(data)
    flips = st.tuples(st.integers(0, n - 1), st.integers(0, 7))
    hot_flips = st.tuples(st.integers(0, min(hot, n) - 1), st.integers(0, 7))
    return st.one_of(
        st.one_of(flips, hot_flips).map(lambda pb: ("flip", pb[0], flip(data, *pb))),
        st.integers(0, n - 1).map(lambda k: ("truncate", k, data[:k])),
        st.binary(min_size=1, max_size=64).map(lambda b: ("append", n, data + b)),
        st.tuples(st.integers(0, min(hot, n) - 1), st.binary(min_size=1, max_size=16)).map(
            lambda pb: ("overwrite", pb[0], data[:pb[0]] + pb[1] + data[pb[0] + len(pb[1]):])),
    )


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)
# what a user can type where a number belongs
NUMBERS = st.one_of(st.integers(-(2**40), 2**40), st.floats(), st.sampled_from([0, 1, -1, 2**63, 2**64, 1e308]),
                    st.booleans(), st.none(), st.text(max_size=8))


def some_replaced(valid, junk: dict[str, st.SearchStrategy], most: int) -> st.SearchStrategy[dict]:
    """Valid arguments (a dict, or a strategy of dicts) with none and up to `most` of them replaced by a value of
    their `junk` strategy: most cases then hold one defect, and the valid cases are many."""
    @st.composite
    def args(draw):
        out = dict(draw(valid) if isinstance(valid, st.SearchStrategy) else valid)
        for name in draw(st.lists(st.sampled_from(sorted(junk)), max_size=most, unique=True)):
            out[name] = draw(junk[name])
        return out

    return args()


class Scratch:
    """A folder for one test's inputs, reused case after case (hypothesis runs many cases per test)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, data: bytes | str) -> Path:
        p = self.root / name
        if p.is_dir() and not p.is_symlink():
            os.rmdir(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        return p

    def special(self, name: str, kind: str) -> Path:
        """`name` as a FIFO, a directory, a missing path, a symlink to a directory or a character device."""
        p = self.root / name
        if p.is_dir() and not p.is_symlink():
            os.rmdir(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "directory":
            p.mkdir()
        elif kind == "link to a directory":
            p.symlink_to(self.root)
        elif kind == "character device":
            p.symlink_to("/dev/zero")
        return p


SPECIALS = st.sampled_from(["fifo", "directory", "missing", "link to a directory", "character device"])
