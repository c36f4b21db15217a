"""Stand-in for pytest-mock (tools/upstream_tests.py): a `mocker` fixture on unittest.mock."""

from unittest import mock as _mock

import pytest


class _Patcher:
    def __init__(self, started):
        self._started = started

    def _start(self, patcher):
        value = patcher.start()
        self._started.append(patcher)
        return value

    def __call__(self, target, *args, **kwargs):
        return self._start(_mock.patch(target, *args, **kwargs))

    def object(self, target, attribute, *args, **kwargs):
        return self._start(_mock.patch.object(target, attribute, *args, **kwargs))

    def dict(self, in_dict, values=(), clear=False, **kwargs):
        return self._start(_mock.patch.dict(in_dict, values, clear=clear, **kwargs))


class MockerFixture:
    Mock = _mock.Mock
    MagicMock = _mock.MagicMock
    ANY = _mock.ANY
    call = _mock.call

    def __init__(self):
        self._started = []
        self.patch = _Patcher(self._started)

    def stopall(self):
        while self._started:
            self._started.pop().stop()


@pytest.fixture
def mocker():
    fixture = MockerFixture()
    yield fixture
    fixture.stopall()
