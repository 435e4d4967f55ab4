"""The server's client-error type and the field checks every request parser shares.

`ApiError` is answered with OpenAI's body {"error": {"message", "type", "param", "code"}};
`bad` is its 400. The helpers read one field of a JSON body and refuse a wrong value naming
the field and the range it takes.
"""

from __future__ import annotations

import math

from exactspec.models.loading import Model


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status  # HTTP status code
        self.message = message  # what went wrong and how to fix it
        self.param = param  # the request field at fault, if any
        self.type = type  # OpenAI error type
        self.code = code  # OpenAI error code, if any
        self.headers = headers or {}  # extra response headers (Retry-After on 429)

    def __reduce__(self):  # pickled across the engine process's pipe
        return (ApiError, (self.status, self.message), dict(self.__dict__))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param)


def utf8_size(text: str, where: str) -> int:
    """The UTF-8 length of `text`; 400 naming `where` if it holds a lone surrogate."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise bad(f"'{where}' holds {text[exc.start]!r} at character {exc.start}, a lone UTF-16 "
                  "surrogate that is no Unicode character; send valid UTF-8 text (a "
                  "surrogate pair for characters beyond U+FFFF)", where) from None


def check_size(size: int, limit: int | None, where: str, model: Model) -> None:
    if limit is not None and size > limit:
        raise bad(f"'{where}' is {size} bytes of text, more than this model's context of "
                  f"{model.max_context} tokens can hold (at most {limit} bytes, from the "
                  "tokenizer's longest token); send a shorter prompt", where)


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_id(v: object) -> bool:
    return is_int(v) and v >= 0  # type: ignore[operator]


def is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def int_field(body: dict, key: str, default: int, low: int, high: int | None) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad(f"'{key}'={value!r} must be an integer {span}", key)
    return value


def float_field(body: dict, key: str, default: float, low: float, high: float | None) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not is_number(value) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad(f"'{key}'={value!r} must be a number {span}", key)
    return float(value)


def bool_field(body: dict, key: str, default: bool, name: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name or key}'={value!r} must be true or false", name or key)
    return value
