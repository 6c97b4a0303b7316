"""The one error base of the console: a refusal in words a person can act on.

Every refusal carries a stable machine `code` (the API's `error` field), the HTTP `status`
the API answers with, and `detail`, the words. Callers decide on the code (or the class),
never on the words: the words may change, the codes are a contract.
"""

from __future__ import annotations


class ConsoleError(Exception):
    code = "console_error"
    status = 400

    def __init__(self, detail: str, *, code: str | None = None, status: int | None = None):
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class ApiError(ConsoleError):
    """Refused by the API layer itself (authentication, token scope, request shape) before
    any service ran."""

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(detail, code=code, status=status)
