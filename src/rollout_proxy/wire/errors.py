"""The wire package's one error: a value without the shape the wire format needs."""

from __future__ import annotations


class WireFormatError(ValueError):
    """``message`` says what is wrong, ``param`` where (a dotted path such as ``messages[2].content``).

    The server answers it as a 400 ``invalid_request_error``; in plugin code it is a
    plain ``ValueError``.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code  # the error's code in the server's answer, where it has one of its own
