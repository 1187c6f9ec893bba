"""Building blocks of every request body: the strict base model and checked text."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


def valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid Unicode text, but character {exc.start} is an unpaired surrogate "
                         f"({value[exc.start]!r})") from None
    return value


Text = Annotated[str, AfterValidator(valid_unicode)]


class RequestModel(BaseModel):
    """A request body or part of one: a string is not an integer, `1` is not `true`, numbers are finite;
    fields no model declares are ignored (the top-level bodies warn about them once)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class ClosedRequestModel(RequestModel):
    """A nested object whose every key this server reads: an unknown key is an error, not ignored."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
