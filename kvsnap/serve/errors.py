"""``ServeError``: a request the server refuses, with the fields of OpenAI's error JSON. No torch."""

from __future__ import annotations

from typing import Any

from kvsnap.errors import KvsnapError


class ServeError(KvsnapError):
    """A request the server refuses, with what the OpenAI error JSON carries."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ServeError:
    return ServeError(400, message, param=param, code=code)
