"""Decorating a replica's ``__init__``, plain or async, with work before it and after it returns."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

Init = TypeVar("Init", bound=Callable[..., Any])
T = TypeVar("T")


def around_init(before: Callable[[str], T], after: Callable[[T], None] | None = None) -> Callable[[Init], Init]:
    """A decorator of ``__init__`` that calls ``before`` with the class name first, then ``__init__``, then
    ``after`` with what ``before`` returned."""

    def decorate(init: Init) -> Init:
        if inspect.iscoroutinefunction(init):
            @functools.wraps(init)
            async def start_async(self: Any, *args: Any, **kwargs: Any) -> None:
                prepared = before(type(self).__name__)
                await init(self, *args, **kwargs)
                if after is not None:
                    after(prepared)

            return start_async  # type: ignore[return-value]

        @functools.wraps(init)
        def start(self: Any, *args: Any, **kwargs: Any) -> None:
            prepared = before(type(self).__name__)
            init(self, *args, **kwargs)
            if after is not None:
                after(prepared)

        return start  # type: ignore[return-value]

    return decorate
