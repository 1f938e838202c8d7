"""A clock that moves only when a test moves it, for code that takes ``clock: Callable[[], float]``."""


class ManualClock:
    """``clock()`` returns ``now``; tests advance ``now`` themselves."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
