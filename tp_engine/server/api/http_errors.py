"""Errors in OpenAI's envelope: `{"error": {"message", "type", "param", "code"}}`.

Every invalid request is a 400 (FastAPI's 422 for validation errors included), a wrong or
missing API key a 401, an unknown model or route a 404; the engine being dead or shutting down
is a 503. `type` and `code` follow OpenAI's spelling, so clients map them to their own
exception classes (`openai.BadRequestError`, `AuthenticationError`, `NotFoundError`, ...).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tp_engine.server.api.flagged_routes import FLAGGED_ROUTES

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}


class APIError(Exception):
    """Raised anywhere in request handling; answered as an OpenAI error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(
    message: str, type: str, param: str | None, code: str | int | None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _flag_for(path: str) -> str | None:
    """The flag or variable that offers a route this server lacks (None: no such route)."""
    return FLAGGED_ROUTES.get(path)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('msg')}"
            param = None
        else:
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problems)"
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            flag = _flag_for(request.url.path)
            if flag is not None:
                message += f" (offered only with {flag})"
        return APIError(exc.status_code, message).response()

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        # Every place that reads nested input names its field (guards.check_nesting and the
        # json parses); this is the backstop, still the client's error and not a 500.
        return APIError(400, "the request nests too deeply to be read").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error answering %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
