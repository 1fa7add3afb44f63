"""Errors as OpenAI clients parse them: the error object, and the HTTP status and error type of each way a
call can end (a gRPC status code names it), of unknown paths and of bugs."""
from __future__ import annotations

from typing import Any

import grpc
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from shared.serving.generation import CallEnded
from shared.serving.pod.outcomes import InvalidRequest

# How an ended call's status shows over HTTP: (HTTP status, OpenAI error type).
_HTTP_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}
SERVER_ERROR = (500, "server_error")


def error_object(message: str, error_type: str, status: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: param names the request field to blame; code is OpenAI's code where it has
    one (model_not_found), else the HTTP status (as vLLM sends it)."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code or status}}


def error(status: int, error_type: str, message: str, headers: dict[str, str] | None = None,
          param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_object(message, error_type, status, param, code), status_code=status, headers=headers)


def invalid(exc: InvalidRequest) -> JSONResponse:
    """400: the request cannot be served as it stands (naming the field to blame, where one is)."""
    return error(400, "invalid_request_error", str(exc), param=exc.param)


def ended_error(ended: CallEnded) -> JSONResponse:
    status, error_type = _HTTP_OF_CODE.get(ended.code, SERVER_ERROR)
    return error(status, error_type, ended.details, ended.retry_after_header)


def ended_error_object(ended: CallEnded) -> dict[str, Any]:
    """The error object of a call that ended mid-stream (its status line already went out)."""
    status, error_type = _HTTP_OF_CODE.get(ended.code, SERVER_ERROR)
    return error_object(ended.details, error_type, status)


async def http_exception(request: Request, exc: HTTPException) -> Response:
    """Unknown paths and methods answered as OpenAI error objects, like every other error."""
    return error(exc.status_code, "invalid_request_error", f"{request.method} {request.url.path}: {exc.detail}")


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug met by one request: an OpenAI error object, not a bare text page (the server logs the traceback)."""
    return error(*SERVER_ERROR, f"internal error: {type(exc).__name__}")
