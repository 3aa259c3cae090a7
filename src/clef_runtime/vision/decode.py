"""Decode one request image safely: bytes -> RGB ``PIL.Image.Image``.

Rules (Cloudflare's hosted limits, plus the reference processor's aspect-ratio limit):

- the format is sniffed from the bytes (the declared content type is not trusted): PNG, JPEG or WebP only;
- at most :data:`MAX_IMAGE_PIXELS` (16,000,000) pixels, checked from the header before any pixel is decoded;
  Pillow's own decompression-bomb guard is on as a second line (``Image.MAX_IMAGE_PIXELS`` is set to the
  same value at import, and ``DecompressionBombWarning`` is turned into an error while decoding);
- aspect ratio (long side / short side) at most 200, as ``smart_resize`` of the reference processor refuses
  more;
- the whole image is decoded (``load()``) inside the guard, so truncated or corrupt data fails here and
  not later; truncated images are never accepted (``ImageFile.LOAD_TRUNCATED_IMAGES`` must stay False);
- animated images (APNG, animated WebP): the first frame;
- transparency is composited onto white, then converted to RGB, exactly as transformers'
  ``convert_to_rgb`` does for the reference processor. EXIF orientation is not applied (the reference
  processor does not apply it either).

Every failure raises :class:`~clef_runtime.protocol.errors.RequestValidationError` naming the image's
``loc``; nothing else escapes (``MemoryError`` aside).
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageFile

from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.images import ImageSource

__all__ = ["MAX_ASPECT_RATIO", "MAX_IMAGE_PIXELS", "decode_image", "sniff_format"]

MAX_IMAGE_PIXELS = 16_000_000
"""Largest accepted width x height (Cloudflare: 16 MP; a 16.38 MP image is refused there)."""
MAX_ASPECT_RATIO = 200.0
"""Largest long-side / short-side ratio (the reference ``smart_resize`` raises above it)."""

# Process-wide on purpose: Pillow refuses to even open anything over 2x this without our help.
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS

# Pillow plugin formats we let Image.open try; "MPO" is a JPEG with extra pictures (phones write it).
_PILLOW_FORMATS = ("PNG", "JPEG", "WEBP")
_ACCEPTED_DECODED_FORMATS = {"PNG": "png", "JPEG": "jpeg", "MPO": "jpeg", "WEBP": "webp"}


def sniff_format(data: bytes) -> str | None:
    """Return ``"png"``, ``"jpeg"`` or ``"webp"`` from the magic bytes, or ``None`` for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def _describe(data: bytes) -> str:
    known = {
        b"GIF8": "a GIF",
        b"BM": "a BMP",
        b"II*\x00": "a TIFF",
        b"MM\x00*": "a TIFF",
        b"\x00\x00\x01\x00": "an ICO",
        b"%PDF": "a PDF",
        b"<svg": "an SVG",
        b"<?xml": "an XML/SVG",
    }
    for magic, name in known.items():
        if data.startswith(magic):
            return name
    if data[4:12] in (b"ftypavif", b"ftypheic", b"ftypheix", b"ftypmif1"):
        return "an AVIF/HEIF"
    return "not a recognised image"


def _error(source: ImageSource, msg: str, type_: str) -> RequestValidationError:
    return RequestValidationError.single(source.loc, msg, type_)


def decode_image(source: ImageSource) -> Image.Image:
    """Decode ``source`` into a fully loaded RGB image (first frame of an animation).

    Returns a ``PIL.Image.Image`` in mode ``RGB``.
    Raises :class:`RequestValidationError` at ``source.loc`` with type ``unsupported_image_format`` (not
    PNG/JPEG/WebP by its bytes), ``image_too_many_pixels`` (over 16 MP, or a decompression bomb),
    ``image_aspect_ratio`` (over 200:1) or ``invalid_image`` (truncated, corrupt, or undecodable).
    """
    if ImageFile.LOAD_TRUNCATED_IMAGES:  # someone flipped the global; never accept partial pixels
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES must be False for safe image decoding")
    data = source.data
    sniffed = sniff_format(data)
    if sniffed is None:
        raise _error(
            source,
            f"unsupported image format ({_describe(data)}); send a PNG, JPEG or WebP image",
            "unsupported_image_format",
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=_PILLOW_FORMATS) as opened:
                decoded_format = _ACCEPTED_DECODED_FORMATS.get(opened.format or "")
                if decoded_format != sniffed:
                    raise _error(
                        source,
                        "the image data is not a valid PNG, JPEG or WebP file",
                        "unsupported_image_format",
                    )
                width, height = opened.size
                # Our own check does not depend on the (process-global) warnings filter.
                if width * height > MAX_IMAGE_PIXELS:
                    raise _error(
                        source,
                        f"image is {width}x{height} = {width * height} px; the limit is {MAX_IMAGE_PIXELS}",
                        "image_too_many_pixels",
                    )
                if width < 1 or height < 1:
                    raise _error(source, "image has no pixels", "invalid_image")
                if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
                    raise _error(
                        source,
                        f"image is {width}x{height}; the aspect ratio must be at most {MAX_ASPECT_RATIO:g}:1",
                        "image_aspect_ratio",
                    )
                if getattr(opened, "n_frames", 1) > 1:
                    opened.seek(0)
                opened.load()
                return _to_rgb(opened)
    except RequestValidationError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise _error(
            source, f"image is too large to decode safely ({err})", "image_too_many_pixels"
        ) from None
    except Image.UnidentifiedImageError:
        raise _error(
            source, "the image data could not be decoded (corrupt or unsupported)", "invalid_image"
        ) from None
    except MemoryError:
        raise
    except Exception as err:  # Pillow raises OSError, ValueError, SyntaxError, struct.error, EOFError, ...
        raise _error(
            source, f"the image data could not be decoded ({type(err).__name__}: {err})", "invalid_image"
        ) from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy of ``image``; transparency composited on white (as transformers' ``convert_to_rgb``)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    rgb = image.convert("RGB")
    if rgb is image:  # convert() can return self for RGB in some Pillow versions; detach from the file
        rgb = image.copy()
    return rgb
