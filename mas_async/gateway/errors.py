"""OpenAI-shaped errors of the gateway: an HTTP status and `{"error": {"message", "type", "param", "code"}}`.

Every refusal of the gateway is one of these, raised where the problem is found and turned into a JSON
response by the server's middleware, so a client sees the error object it would see from the OpenAI API
(the `openai` package raises `BadRequestError`, `AuthenticationError`, `NotFoundError`, ... from it) and
the worker never crashes or hangs on a bad request.
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    """A request the gateway refuses: `status` and the fields of the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    """400: a field is missing, of the wrong type or out of range."""
    return GatewayError(400, message, param=param, code=code)
