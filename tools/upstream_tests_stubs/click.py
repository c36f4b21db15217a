"""Stand-in for click (tools/upstream_tests.py): decorators that leave functions as they are."""


def _identity_decorator(*args, **kwargs):
    def wrap(func):
        return func

    return wrap


command = group = option = argument = _identity_decorator


def echo(message=None, **kwargs):
    print(message)
