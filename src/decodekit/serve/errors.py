"""The server's errors as OpenAI error objects: :class:`ApiError` carries the HTTP status, the
error's type and the request field at fault to the handler that answers it; the faults found
while decoding that are the server's own (a 500, not the request's 400) are :data:`SERVER_FAULTS`."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from ..errors import CacheError, ClusterError, InvalidModel, ModelNotFound


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


#: Errors raised while a request decodes that are the server's fault, not the request's: a model or
#: a cache found damaged (a 500, where the request's own faults are 400s).
SERVER_FAULTS = (InvalidModel, CacheError, ModelNotFound, ClusterError)


def internal_error(err: Exception) -> str:
    """A 500's message for an error no check foresaw (its type and text, never a traceback)."""
    return f"internal error: {type(err).__name__}: {err}"


def shutting_down() -> ApiError:
    """The answer to a request the server stopped because it is shutting down (a 503 to retry elsewhere)."""
    return ApiError(503, "the server is shutting down: this answer was stopped before its end; retry", "server_error",
                    code="server_shutting_down")


class ClientGone(Exception):
    """The client closed the connection before its answer: nobody to answer, nothing to count as an error."""


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An OpenAI error object (what goes under ``"error"``, in a reply or in a stream's event). A lone
    surrogate the request sent (a field named ``"\\ud800"``), which UTF-8 cannot encode, is written as
    its escape: the error is still answered."""
    return {"message": writable(message), "type": kind, "param": None if param is None else writable(param), "code": code}


def writable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (lone surrogates) as backslash escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": error_body(message, kind, param, code)}
    return JSONResponse(body, status_code=status, headers=headers)
