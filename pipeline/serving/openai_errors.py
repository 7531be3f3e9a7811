"""The refusal of the OpenAI-compatible routes, in OpenAI's error shape; shared by pipeline.serving.openai_api and
pipeline.serving.openai_tools (which openai_api uses), so that neither imports the other for it."""

from __future__ import annotations

from pipeline.errors import InputError


class APIError(InputError):
    """A request refused in OpenAI's shape: HTTP `status`, the `param` at fault (or None) and OpenAI's `code`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}
