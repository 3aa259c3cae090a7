"""decode_image: accepted formats, RGB conversion, every bad image -> RequestValidationError at its loc."""

from __future__ import annotations

import base64
import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.images import ImageSource, extract_images
from clef_runtime.vision.decode import MAX_IMAGE_PIXELS, decode_image, sniff_format
from tests.vision.helpers import encode, photo_like

LOC = ("images", 2)


def source(data: bytes, content_type: str | None = "image/png", loc=LOC) -> ImageSource:
    return ImageSource(data=data, content_type=content_type, loc=loc)


def refused(data: bytes, loc=LOC) -> dict:
    with pytest.raises(RequestValidationError) as caught:
        decode_image(source(data, loc=loc))
    (error,) = caught.value.errors
    assert error["loc"] == loc
    assert error["msg"]
    return error


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares a huge 1-bit grayscale image (a decompression bomb)."""
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")
    )


# --- accepted images ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "options"), [("PNG", {}), ("JPEG", {"quality": 90}), ("WEBP", {"lossless": True})]
)
def test_supported_formats_decode_to_rgb(fmt, options):
    original = photo_like(40, 30)
    decoded = decode_image(source(encode(original, fmt, **options), content_type="image/jpeg"))
    assert decoded.mode == "RGB" and decoded.size == (40, 30)
    if fmt != "JPEG":  # lossless
        assert np.array_equal(np.asarray(decoded), np.asarray(original))


def test_transparency_is_composited_on_white():
    rgba = np.zeros((2, 3, 4), dtype=np.uint8)
    rgba[0, 0] = (10, 20, 30, 0)  # fully transparent -> white
    rgba[0, 1] = (10, 20, 30, 255)  # opaque -> itself
    rgba[0, 2] = (0, 0, 0, 128)  # half -> mid grey
    decoded = np.asarray(decode_image(source(encode(Image.fromarray(rgba, "RGBA"), "PNG"))))
    assert decoded[0, 0].tolist() == [255, 255, 255]
    assert decoded[0, 1].tolist() == [10, 20, 30]
    assert 125 <= decoded[0, 2, 0] <= 128


def test_palette_transparency_and_grayscale_become_rgb():
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    data = encode(palette, "PNG", transparency=0)
    assert decode_image(source(data)).getpixel((0, 0)) == (200, 10, 10)
    gray = Image.fromarray(np.full((3, 3), 77, dtype=np.uint8), "L")
    assert decode_image(source(encode(gray, "PNG"))).getpixel((1, 1)) == (77, 77, 77)


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_animated_images_give_the_first_frame(fmt):
    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    options = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, **options)
    with Image.open(io.BytesIO(data)) as check:
        assert check.n_frames == 3
    assert decode_image(source(data)).getpixel((4, 4)) == (255, 0, 0)


def test_exactly_16_megapixels_is_accepted():
    big = Image.new("1", (4000, 4000), 0)
    assert MAX_IMAGE_PIXELS == 4000 * 4000
    assert decode_image(source(encode(big, "PNG"))).size == (4000, 4000)


def test_aspect_ratio_200_is_accepted():
    assert decode_image(source(encode(Image.new("RGB", (200, 1)), "PNG"))).size == (200, 1)


def test_sniff_format():
    assert sniff_format(b"\x89PNG\r\n\x1a\nrest") == "png"
    assert sniff_format(b"\xff\xd8\xff\xe0") == "jpeg"
    assert sniff_format(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "webp"
    assert sniff_format(b"GIF89a") is None
    assert sniff_format(b"") is None


# --- refused images -------------------------------------------------------------------------------------


def test_truncated_png():
    data = encode(photo_like(64, 64), "PNG")
    assert refused(data[: len(data) // 2])["type"] == "invalid_image"


def test_truncated_jpeg():
    data = encode(photo_like(64, 64), "JPEG")
    assert refused(data[: len(data) // 2])["type"] == "invalid_image"


def test_truncated_webp():
    data = encode(photo_like(64, 64), "WEBP")
    assert refused(data[: len(data) // 2])["type"] == "invalid_image"


def test_random_bytes():
    data = np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    assert refused(data)["type"] == "unsupported_image_format"


@pytest.mark.parametrize(("fmt", "name"), [("GIF", "GIF"), ("BMP", "BMP"), ("TIFF", "TIFF")])
def test_other_formats_are_refused_by_their_bytes(fmt, name):
    error = refused(encode(photo_like(16, 16), fmt))
    assert error["type"] == "unsupported_image_format"
    assert name in error["msg"]


def test_magic_bytes_with_garbage_behind():
    assert refused(b"\x89PNG\r\n\x1a\n" + b"\x00" * 100)["type"] == "invalid_image"
    assert refused(b"RIFF\x10\x00\x00\x00WEBPjunkjunkjunk")["type"] == "invalid_image"
    assert refused(b"\xff\xd8\xff" + b"\x01" * 50)["type"] == "invalid_image"


def test_20_megapixel_png_bomb():
    bomb = encode(Image.new("1", (5000, 4000), 0), "PNG")
    assert len(bomb) < 100_000  # small on the wire, 60 MB as RGB
    assert refused(bomb)["type"] == "image_too_many_pixels"


def test_16_38_megapixels_is_refused():
    assert refused(png_declaring(4096, 4000))["type"] == "image_too_many_pixels"


def test_huge_declared_size_is_refused_before_decoding():
    assert refused(png_declaring(100_000, 100_000))["type"] == "image_too_many_pixels"


def test_own_pixel_check_does_not_rely_on_pillow_guard(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert refused(png_declaring(5000, 4000))["type"] == "image_too_many_pixels"


def test_pillow_guard_is_configured_and_warnings_filters_are_restored():
    assert Image.MAX_IMAGE_PIXELS == MAX_IMAGE_PIXELS
    before = list(warnings.filters)
    refused(png_declaring(5000, 4000))
    assert list(warnings.filters) == before


def test_aspect_ratio_over_200_is_refused():
    assert refused(encode(Image.new("RGB", (201, 1)), "PNG"))["type"] == "image_aspect_ratio"


def test_truncated_images_are_never_accepted_even_if_the_global_is_flipped(monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError):
        decode_image(source(encode(photo_like(8, 8), "PNG")))


def test_damaged_images_never_raise_anything_else():
    rng = np.random.default_rng(7)
    originals = [
        encode(photo_like(48, 40, seed=1), "PNG"),
        encode(photo_like(48, 40, seed=2), "JPEG", quality=80),
        encode(photo_like(48, 40, seed=3), "WEBP"),
        encode(photo_like(48, 40, seed=4), "PNG", save_all=True, append_images=[photo_like(48, 40, seed=5)]),
    ]
    outcomes = {"ok": 0, "refused": 0}
    for trial in range(240):
        data = bytearray(originals[trial % len(originals)])
        if trial % 3 == 0:
            data = data[: int(rng.integers(1, len(data)))]
        else:
            for _ in range(int(rng.integers(1, 8))):
                data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        try:
            image = decode_image(source(bytes(data)))
        except RequestValidationError as err:
            assert err.errors[0]["loc"] == LOC
            outcomes["refused"] += 1
        else:
            assert image.mode == "RGB"
            outcomes["ok"] += 1
    assert outcomes["refused"] > 50


# --- the whole path: raw request -> extract_images -> decode_image ---------------------------------------


def decode_request(raw: dict) -> list[Image.Image]:
    _, sources = extract_images(raw)
    return [decode_image(s) for s in sources]


def b64_url(data: bytes, content_type: str = "image/png") -> str:
    return f"data:{content_type};base64,{base64.b64encode(data).decode()}"


def bad_requests() -> list[tuple[str, dict, tuple]]:
    good = b64_url(encode(photo_like(16, 16), "PNG"))
    png = encode(photo_like(64, 64), "PNG")
    state_part = {"type": "image_url", "image_url": {"url": b64_url(png[:100])}}
    return [
        ("truncated png", {"images": [good, b64_url(png[: len(png) // 2])]}, ("images", 1)),
        ("random bytes", {"images": [b64_url(bytes(range(256)) * 4)]}, ("images", 0)),
        ("gif", {"images": [b64_url(encode(photo_like(8, 8), "GIF"), "image/png")]}, ("images", 0)),
        ("bmp", {"images": [b64_url(encode(photo_like(8, 8), "BMP"), "image/jpeg")]}, ("images", 0)),
        (
            "gif content type",
            {"images": [b64_url(encode(photo_like(8, 8), "GIF"), "image/gif")]},
            ("images", 0),
        ),
        (
            "20 MP bomb",
            {"images": [good, good, b64_url(encode(Image.new("1", (5000, 4000)), "PNG"))]},
            ("images", 2),
        ),
        ("declared bomb", {"images": [b64_url(png_declaring(10**5, 10**5))]}, ("images", 0)),
        ("5 images", {"images": [good] * 5}, ("images", 4)),
        ("4 MiB + 1", {"images": [b64_url(bytes(4 * 1024 * 1024 + 1))]}, ("images", 0)),
        ("https", {"images": ["https://example.com/a.png"]}, ("images", 0)),
        ("bad base64", {"images": ["data:image/png;base64,%%%"]}, ("images", 0)),
        ("state truncated", {"state": ["t", state_part]}, ("state", 1)),
    ]


@pytest.mark.parametrize(("name", "fields", "loc"), bad_requests(), ids=[case[0] for case in bad_requests()])
def test_bad_images_in_requests_name_their_loc(name, fields, loc):
    raw = {"model": "clef-flash", "state": "s", "questions": {"q": {"type": "noul"}}, **fields}
    with pytest.raises(RequestValidationError) as caught:
        decode_request(raw)
    assert caught.value.errors[0]["loc"] == loc, name
