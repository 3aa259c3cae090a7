"""Images in a System One request: find them, check the wire-level limits, and take them out of the request.

Pure Python (+ pydantic for the OpenAPI models); nothing here decodes pixels. Decoding and the pixel limits
live in :mod:`clef_runtime.vision.decode`.

Accepted forms (all images must be inline ``data:`` URLs; remote URLs are refused and never fetched):

1. Cloudflare's top-level ``images`` list. Each item is one of

   - a data URL string: ``"data:image/png;base64,iVBOR..."``;
   - an object ``{"content_type": "image/png", "base64": "iVBOR..."}``;
   - for leniency, also an ``image_url`` / ``input_image`` part (form 2 / 3 below).

2. OpenRouter / llama.cpp: ``state`` is an array and some of its **top-level** items are
   ``{"type": "image_url", "image_url": {"url": "data:...", "detail": ...}}`` (``detail`` is ignored;
   ``image_url`` may also be the URL string itself).

3. OpenAI-shaped ``input_image`` parts in the same ``state`` array:
   ``{"type": "input_image", "image_url": "data:...", "detail": ...}`` (OpenAI's shape: ``image_url`` is a
   string; ``{"url": ...}`` is accepted too). ``file_id`` references are refused.

Images nested deeper (inside objects or inside items of the state array) are not read; they stay part of
the text state, as OpenRouter documents.

What the state becomes once image items are taken out of a ``state`` array (only when at least one image
item was found; a state array without image items is left exactly as sent):

- no item remains -> ``""`` (an empty text state: the request is about the images alone);
- exactly one item remains and it is a string -> that string (OpenRouter's ``["text", {image}]`` then
  renders like the plain text state ``"text"``);
- otherwise -> the list of the remaining items, in their original order (rendered as JSON by the encoder).

Order of the images: all images of the top-level ``images`` list first (in list order), then the images of
the ``state`` array (in array order). The encoder places them in one block right after the prompt prefix,
in this order, like the reference ``encode_record`` which receives one list of images.

Limits (checked here, before any base64 decoding; the decoded size is computed from the base64 length):
at most :data:`MAX_IMAGES` images in total, each at most :data:`MAX_IMAGE_BYTES` decoded bytes, all
together at most :data:`MAX_TOTAL_IMAGE_BYTES`. Content types: ``image/png``, ``image/jpeg``
(``image/jpg`` is an alias), ``image/webp``. The declared type is only a first filter; the decoder sniffs
the bytes.

Every problem is reported as :class:`~clef_runtime.protocol.errors.RequestValidationError` whose items have
``loc`` ``("images", i)`` for the top-level list (``("images",)`` when the field itself is malformed) or
``("state", j)`` for an item of the state array. Error ``type`` values: ``images_type``, ``image_type``,
``too_many_images``, ``image_url_not_allowed``, ``invalid_data_url``, ``unsupported_media_type``,
``invalid_base64``, ``image_too_large``, ``images_too_large``, ``missing``.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from clef_runtime.protocol.errors import ErrorItem, RequestValidationError
from clef_runtime.protocol.systemone import SystemOneRequest, parse_request

__all__ = [
    "ALLOWED_CONTENT_TYPES",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_TOTAL_IMAGE_BYTES",
    "Base64Image",
    "ImageSource",
    "ImageUrl",
    "StateImageUrlPart",
    "StateInputImagePart",
    "add_image_fields",
    "extract_images",
    "normalize_content_type",
    "parse_with_images",
]

MAX_IMAGES = 4
"""At most this many images per request (Cloudflare's limit for clef / clef-flash)."""
MAX_IMAGE_BYTES = 4 * 1024 * 1024
"""Largest decoded (base64-decoded) size of one image, in bytes (4 MiB)."""
MAX_TOTAL_IMAGE_BYTES = 8 * 1024 * 1024
"""Largest decoded size of all images of one request together, in bytes (8 MiB)."""

ALLOWED_CONTENT_TYPES = ("image/png", "image/jpeg", "image/webp")
_CONTENT_TYPE_ALIASES = {"image/jpg": "image/jpeg"}
_IMAGE_PART_TYPES = ("image_url", "input_image")
_BASE64_WHITESPACE = re.compile(r"[ \t\r\n]+")
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


@dataclass(frozen=True, slots=True)
class ImageSource:
    """One image as sent: its decoded bytes, the declared content type (normalised, e.g. ``image/jpeg``;
    ``None`` when the sender gave none) and where it was in the request (``("images", i)`` or
    ``("state", j)``), used to name it in errors."""

    data: bytes
    content_type: str | None
    loc: tuple[str | int, ...]

    def __repr__(self) -> str:  # never dump megabytes into logs
        return f"ImageSource({len(self.data)} bytes, content_type={self.content_type!r}, loc={self.loc!r})"


# --- pydantic models: only for the OpenAPI description of the accepted shapes (validation is done by hand
# below so that every error names the exact image); `add_image_fields` puts them into the published schema. --


class Base64Image(BaseModel):
    """Cloudflare's object form of an image."""

    model_config = ConfigDict(extra="ignore")
    content_type: str = Field(description="image/png, image/jpeg (image/jpg) or image/webp")
    base64: str = Field(description="the image file, base64-encoded (at most 4 MiB decoded)")


class ImageUrl(BaseModel):
    """The ``image_url`` object of an OpenRouter / OpenAI chat image part."""

    model_config = ConfigDict(extra="ignore")
    url: str = Field(description="a data: URL (data:image/png;base64,...); remote URLs are refused")
    detail: str | None = Field(default=None, description="ignored")


class StateImageUrlPart(BaseModel):
    """An image item of a ``state`` array (OpenRouter / llama.cpp)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageUrl | str


class StateInputImagePart(BaseModel):
    """An OpenAI-shaped image part in a ``state`` array."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["input_image"]
    image_url: str | ImageUrl
    detail: str | None = Field(default=None, description="ignored")


class _ImageFields(BaseModel):
    """The image fields of a System One request, as published (see `add_image_fields`)."""

    images: list[Annotated[str, Field(description="a data: URL")] | Base64Image] | None = Field(
        default=None,
        max_length=MAX_IMAGES,
        description=(
            f"At most {MAX_IMAGES} images (PNG, JPEG or WebP; {MAX_IMAGE_BYTES // 2**20} MiB each, "
            f"{MAX_TOTAL_IMAGE_BYTES // 2**20} MiB in total), placed before the state."
        ),
    )
    state_parts: list[StateImageUrlPart | StateInputImagePart]


def add_image_fields(request_schema: dict[str, Any], ref_template: str) -> dict[str, Any]:
    """Add the ``images`` field and the image parts of a ``state`` array to the JSON schema of
    ``SystemOneRequest`` (in place), so that the published schema describes every accepted shape (and schema
    fuzzers send images). Returns the definitions the additions refer to (for ``components/schemas``)."""
    fields = _ImageFields.model_json_schema(ref_template=ref_template)
    definitions: dict[str, Any] = fields.pop("$defs", {})
    properties = request_schema["properties"]
    properties["images"] = fields["properties"]["images"]
    image_parts = fields["properties"]["state_parts"]["items"]["anyOf"]
    for member in properties["state"]["anyOf"]:
        if member.get("type") == "array":
            member["items"] = {"anyOf": [*image_parts, {}]}
    return definitions


# --- extraction ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Pending:
    """An image found in the request, not yet base64-decoded."""

    loc: tuple[str | int, ...]
    content_type: str
    payload: str  # base64 text with whitespace removed
    decoded_size: int


class _ItemError(Exception):
    def __init__(self, msg: str, type_: str) -> None:
        super().__init__(msg)
        self.msg = msg
        self.type = type_


def normalize_content_type(content_type: str) -> str | None:
    """Return the canonical form of an accepted image content type (``image/jpg`` -> ``image/jpeg``), or
    ``None`` when the type is not one of :data:`ALLOWED_CONTENT_TYPES`. Parameters (``;charset=...``) and
    case are ignored."""
    base = content_type.split(";", 1)[0].strip().lower()
    base = _CONTENT_TYPE_ALIASES.get(base, base)
    return base if base in ALLOWED_CONTENT_TYPES else None


def _checked_content_type(declared: str) -> str:
    content_type = normalize_content_type(declared)
    if content_type is None:
        shown = declared.strip()[:64] or "(none)"
        raise _ItemError(
            f"unsupported image content type {shown!r}; use image/png, image/jpeg or image/webp",
            "unsupported_media_type",
        )
    return content_type


def _decoded_size(payload: str) -> int:
    """Bytes that ``payload`` (base64 without whitespace) decodes to, computed without decoding it."""
    data_chars = len(payload.rstrip("="))
    return data_chars * 3 // 4


def _prepare_payload(text: str) -> tuple[str, int]:
    payload = _BASE64_WHITESPACE.sub("", text)
    if not payload:
        raise _ItemError("the image data is empty", "invalid_base64")
    return payload, _decoded_size(payload)


def _parse_data_url(url: str) -> tuple[str, str, int]:
    """Split a ``data:`` URL into (content type, base64 payload, decoded size)."""
    stripped = url.strip()
    if stripped[:5].lower() != "data:":
        if _URL_SCHEME.match(stripped):
            scheme = stripped.split(":", 1)[0].lower()
            msg = f"{scheme}: image URLs are not fetched; send the image inline as a data: URL"
        else:
            msg = "expected a data: URL (data:image/png;base64,...)"
        raise _ItemError(msg, "image_url_not_allowed")
    header, sep, body = stripped[5:].partition(",")
    if not sep:
        raise _ItemError("malformed data: URL (no comma before the data)", "invalid_data_url")
    params = [p.strip() for p in header.split(";")]
    if len(params) < 2 or params[-1].lower() != "base64":
        raise _ItemError(
            "the data: URL must be base64-encoded (data:image/png;base64,...)", "invalid_data_url"
        )
    content_type = _checked_content_type(params[0])
    payload, size = _prepare_payload(body)
    return content_type, payload, size


def _parse_part_url(item: dict[str, Any]) -> tuple[str, str, int]:
    image_url = item.get("image_url")
    if isinstance(image_url, dict):
        image_url = image_url.get("url")
    if not isinstance(image_url, str):
        if item.get("file_id") is not None:
            raise _ItemError("file_id image references are not supported; send a data: URL", "image_type")
        raise _ItemError(f"a {item.get('type')} item needs image_url (a data: URL)", "missing")
    return _parse_data_url(image_url)


def _is_image_part(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") in _IMAGE_PART_TYPES


def _parse_top_level_image(item: Any) -> tuple[str, str, int]:
    if isinstance(item, str):
        return _parse_data_url(item)
    if _is_image_part(item):
        return _parse_part_url(item)
    if isinstance(item, dict):
        if not isinstance(item.get("base64"), str):
            raise _ItemError("an image object needs a base64 string", "missing")
        declared = item.get("content_type")
        if not isinstance(declared, str):
            raise _ItemError(
                "an image object needs content_type (image/png, image/jpeg or image/webp)", "missing"
            )
        content_type = _checked_content_type(declared)
        payload, size = _prepare_payload(item["base64"])
        return content_type, payload, size
    raise _ItemError(
        'an image is a data: URL or an object {"content_type": ..., "base64": ...}',
        "image_type",
    )


def _remaining_state(items: list[Any]) -> Any:
    if not items:
        return ""
    if len(items) == 1 and isinstance(items[0], str):
        return items[0]
    return items


def extract_images(raw: dict[str, Any]) -> tuple[dict[str, Any], list[ImageSource]]:
    """Take the images out of a raw (JSON-decoded) System One request.

    Returns ``(request, sources)``: ``request`` is a shallow copy of ``raw`` without the ``images`` field and,
    when the ``state`` array held image items, with ``state`` replaced as described in the module docstring;
    ``sources`` are the images in block order (top-level ``images`` first, then the state array's), with
    their base64 decoded. ``raw`` itself is not modified. A ``raw`` that is not a dict is returned unchanged
    with no images (the request parser reports it).

    Raises :class:`RequestValidationError` listing every problem found (too many images -> one error at the
    first image over the limit, nothing decoded; per image: remote/non-data URL, malformed data URL,
    unsupported content type, bad base64, too large; all images together too large).
    """
    if not isinstance(raw, dict):
        return raw, []
    request = dict(raw)
    errors: list[ErrorItem] = []
    # (loc, item) of every image item, in block order.
    found: list[tuple[tuple[str | int, ...], Any]] = []

    images_field = request.pop("images", None)
    if images_field is not None:
        if isinstance(images_field, list):
            found.extend((("images", i), item) for i, item in enumerate(images_field))
        else:
            errors.append({"loc": ("images",), "msg": "images must be a list", "type": "images_type"})

    state = request.get("state")
    if isinstance(state, list) and any(_is_image_part(item) for item in state):
        found.extend((("state", j), item) for j, item in enumerate(state) if _is_image_part(item))
        request["state"] = _remaining_state([item for item in state if not _is_image_part(item)])

    if len(found) > MAX_IMAGES:
        loc = found[MAX_IMAGES][0]
        errors.append(
            {
                "loc": loc,
                "msg": f"at most {MAX_IMAGES} images per request, got {len(found)}",
                "type": "too_many_images",
            }
        )
        raise RequestValidationError(errors)

    pending: list[_Pending] = []
    total = 0
    for loc, item in found:
        try:
            content_type, payload, size = _parse_top_level_image(item)
        except _ItemError as err:
            errors.append({"loc": loc, "msg": err.msg, "type": err.type})
            continue
        if size > MAX_IMAGE_BYTES:
            errors.append(
                {
                    "loc": loc,
                    "msg": f"image is {size} bytes; the limit is {MAX_IMAGE_BYTES} bytes (4 MiB) per image",
                    "type": "image_too_large",
                }
            )
            continue
        total += size
        if total > MAX_TOTAL_IMAGE_BYTES:
            errors.append(
                {
                    "loc": loc,
                    "msg": f"images total more than {MAX_TOTAL_IMAGE_BYTES} bytes (8 MiB) per request",
                    "type": "images_too_large",
                }
            )
            continue
        pending.append(_Pending(loc, content_type, payload, size))
    if errors:
        raise RequestValidationError(errors)

    sources: list[ImageSource] = []
    for image in pending:
        try:
            data = _b64decode(image.payload)
        except _ItemError as err:
            errors.append({"loc": image.loc, "msg": err.msg, "type": err.type})
            continue
        sources.append(ImageSource(data=data, content_type=image.content_type, loc=image.loc))
    if errors:
        raise RequestValidationError(errors)
    return request, sources


def _b64decode(payload: str) -> bytes:
    # Standard alphabet only; missing trailing padding is tolerated (some clients strip it).
    if len(payload) % 4 == 1:
        raise _ItemError("invalid base64 image data (bad length)", "invalid_base64")
    padded = payload + "=" * (-len(payload) % 4)
    try:
        return base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError) as err:
        raise _ItemError(f"invalid base64 image data ({err})", "invalid_base64") from None


def parse_with_images(request: Any) -> tuple[SystemOneRequest, list[ImageSource]]:
    """Validate a System One request body with its images: a JSON-decoded dict (images in ``images`` or in
    the ``state`` array, see `extract_images`) or an already parsed ``SystemOneRequest`` (text only).

    Returns ``(request, sources)``: the request without its images, and the images in block order. Raises
    :class:`RequestValidationError` naming every bad field or image.
    """
    body, sources = extract_images(request)
    return parse_request(body), sources
