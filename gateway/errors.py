"""The GatewayError tree: each class owns its HTTP status and OpenAI error type."""

from __future__ import annotations

from typing import Any

# Status of a request whose client went away before the answer (nginx's convention): not an error of the
# gateway's or the deployment's, so it never counts against a rollout.
CLIENT_CLOSED = 499

class GatewayError(Exception):
    """An error a client may see; the message must never carry a secret or a stack trace."""

    status = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"


class ContextTooLong(BadRequest):
    code = "context_length_exceeded"


class Unauthorized(GatewayError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    error_type = "permission_error"


class NotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(GatewayError):
    status = 409
    error_type = "conflict_error"
    code = "stale_generation"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeout(GatewayError):
    """The client did not send its request's head in time (a slow or stuck client)."""

    status = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


class HeaderTooLarge(GatewayError):
    status = 431
    error_type = "invalid_request_error"
    code = "header_too_large"


class RateLimited(GatewayError):
    """Budget or rate limit reached; carries Retry-After."""

    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(max(1, int(retry_after_s + 0.999)))})
        self.retry_after_s = retry_after_s


class UpstreamError(GatewayError):
    """The deployment failed (connection refused, 5xx, broken stream)."""

    status = 502
    error_type = "upstream_error"
    code = "upstream_failed"


class NoHealthyDeployment(GatewayError):
    status = 503
    error_type = "service_unavailable"
    code = "no_healthy_deployment"


class StoreUnavailable(GatewayError):
    """The shared store (Redis) is unreachable and the policy says to reject."""

    status = 503
    error_type = "service_unavailable"
    code = "store_unavailable"


class UpstreamTimeout(UpstreamError):
    status = 504
    error_type = "timeout_error"
    code = "upstream_timeout"
