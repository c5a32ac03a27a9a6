"""What every request model of the router's protocol shares: strict validation, no unknown
fields, and text and integers bounded to what the bus can carry."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1


def _utf8_encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"must be valid Unicode text: a lone surrogate at position {error.start}") from None
    return text


Text = Annotated[str, AfterValidator(_utf8_encodable)]  # a string the tokenizer and the bus can carry
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]


class Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
