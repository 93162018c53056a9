"""features.extract's walk over a chat's messages and its markers in C (gateway/native/_features_walk.c)."""

from collections.abc import Callable, Sequence
from typing import Any

# system, history and last-user tokens, message count, user turns, tool-result turns, prior answers, last user text,
# has_code, has_math: features.Walk
_Walk = tuple[int, int, int, int, int, int, int, str, bool, bool]

class Walker:
    """The walk with these markers (ASCII, 2+ characters, at most 64 a set) and budgets, copied."""

    def __new__(
        cls,
        *,
        code_markers: Sequence[str],
        math_markers: Sequence[str],
        math_symbols: str,
        exact_chars_per_message: int,
        scan_chars: int,
    ) -> Walker: ...
    def walk(
        self,
        messages: Any,
        exact_chars_left: int,
        count: Callable[[str], int] | None,
        estimate: Callable[[str], int],
        /,
    ) -> tuple[_Walk, int, bool] | None:
        """The walk, the exact-count budget left and whether every count was exact; None when `messages` is not a
        list of the shape it reads (dicts of str roles and str or absent contents), left to the Python walk."""
    def markers(self, window: str, /) -> tuple[bool, bool]:
        """has_code and has_math of a window built elsewhere (features.scan_window's)."""
