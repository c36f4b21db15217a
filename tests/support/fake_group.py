"""A stand-in for a process group where code only asks its size and this rank."""


class FakeGroup:
    """``size()`` and ``rank()`` of a process group, without one."""

    def __init__(self, size: int = 1, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank
