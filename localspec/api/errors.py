"""The API's failures, each with its HTTP status and OpenAI's error ``type`` and ``code``."""

from __future__ import annotations

from localspec.errors import LocalSpecError

API_RETRY_AFTER_S = 5  # what a 429 or a 503 (models loading) asks a client to wait


class ApiError(LocalSpecError):
    """A request the API answers with an error JSON instead of a completion."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {}


class BadRequest(ApiError):
    """400: a malformed body, a field out of range, a feature that is not supported."""


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class NotFound(ApiError):
    """404: an unknown model or route."""

    status = 404
    code = "model_not_found"


class TooLarge(ApiError):
    """413: a body past the size limit, or a prompt the model's context cannot hold."""

    status = 413
    code = "context_length_exceeded"


class Busy(ApiError):
    """429 (the queue is full) or 503 (no model loaded yet): try again after a while."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(API_RETRY_AFTER_S)}


class Loading(Busy):
    status = 503
    type = "service_unavailable"
    code = "model_loading"


class ServerError(ApiError):
    """500: a generation that failed (a model file gone bad), or a bug (its traceback logged)."""

    status = 500
    type = "server_error"
