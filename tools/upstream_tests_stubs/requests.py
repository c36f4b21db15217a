"""Stand-in for requests (tools/upstream_tests.py): there is no network here."""


class RequestException(OSError):
    pass


class ConnectionError(RequestException):
    pass


class HTTPError(RequestException):
    pass


def _no_network(url, *args, **kwargs):
    raise ConnectionError(f"requests is a stand-in on this machine (no network): {url}")


get = post = put = head = delete = request = _no_network
