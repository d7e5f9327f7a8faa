"""The one exception of the bench kit."""


class BenchError(RuntimeError):
    """A benchmark cannot run as asked (no GPU, bad argument); str() says what to do."""
