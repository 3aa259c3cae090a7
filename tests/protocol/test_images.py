"""extract_images: the accepted image forms, what the state becomes, the order, and every wire-level error."""

from __future__ import annotations

import base64
import copy

import pytest

from clef_runtime.protocol import images as images_module
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.images import (
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    MAX_TOTAL_IMAGE_BYTES,
    ImageSource,
    extract_images,
    normalize_content_type,
    parse_with_images,
)
from clef_runtime.protocol.systemone import SystemOneRequest

QUESTIONS = {"q": {"type": "noul", "instructions": "Is it a cat?"}}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(data: bytes, content_type: str = "image/png") -> str:
    return f"data:{content_type};base64,{b64(data)}"


def request(**fields):
    return {"model": "clef-flash", "state": "text", "questions": QUESTIONS, **fields}


def errors_of(raw) -> list[dict]:
    with pytest.raises(RequestValidationError) as caught:
        extract_images(raw)
    return caught.value.errors


# --- accepted forms -------------------------------------------------------------------------------------


def test_no_images_returns_the_request_and_no_sources():
    raw = request()
    out, sources = extract_images(raw)
    assert out == raw
    assert sources == []


def test_cloudflare_data_urls_and_objects_in_list_order():
    raw = request(
        images=[
            data_url(b"first", "image/png"),
            {"content_type": "image/jpg", "base64": b64(b"second")},
            data_url(b"third", "IMAGE/WEBP"),
        ]
    )
    before = copy.deepcopy(raw)
    out, sources = extract_images(raw)
    assert raw == before, "the input must not be modified"
    assert "images" not in out
    assert out["state"] == "text" and out["questions"] == QUESTIONS and out["model"] == "clef-flash"
    assert sources == [
        ImageSource(b"first", "image/png", ("images", 0)),
        ImageSource(b"second", "image/jpeg", ("images", 1)),
        ImageSource(b"third", "image/webp", ("images", 2)),
    ]


def test_null_or_empty_images_field_is_removed():
    for value in (None, []):
        out, sources = extract_images(request(images=value))
        assert "images" not in out and sources == []


def test_data_url_parameters_whitespace_and_missing_padding_are_tolerated():
    payload = b"abcd"  # base64 "YWJjZA==" -> sent without padding and wrapped
    url = "data:image/png;name=x.png;base64,YWJj\nZA"
    _, sources = extract_images(request(images=[url]))
    assert sources[0].data == payload


def test_state_array_image_url_items_leave_a_single_string():
    raw = request(
        state=[
            "Is the cat on the mat?",
            {"type": "image_url", "image_url": {"url": data_url(b"img"), "detail": "high"}},
        ]
    )
    out, sources = extract_images(raw)
    assert out["state"] == "Is the cat on the mat?"
    assert sources == [ImageSource(b"img", "image/png", ("state", 1))]


def test_state_array_remaining_items_keep_their_order_as_a_list():
    state = [
        {"type": "image_url", "image_url": {"url": data_url(b"a")}},
        "caption",
        {"ticket": 7},
        {"type": "input_image", "image_url": data_url(b"b", "image/jpeg")},
    ]
    out, sources = extract_images(request(state=state))
    assert out["state"] == ["caption", {"ticket": 7}]
    assert [(s.data, s.loc) for s in sources] == [(b"a", ("state", 0)), (b"b", ("state", 3))]


def test_state_array_of_images_only_becomes_empty_text():
    out, _ = extract_images(request(state=[{"type": "image_url", "image_url": {"url": data_url(b"a")}}]))
    assert out["state"] == ""


def test_state_array_single_non_string_item_stays_a_list():
    state = [{"type": "image_url", "image_url": data_url(b"a")}, {"k": 1}]
    out, _ = extract_images(request(state=state))
    assert out["state"] == [{"k": 1}]


def test_state_array_without_images_is_untouched():
    state = ["only text"]
    out, sources = extract_images(request(state=state))
    assert out["state"] is state and sources == []


def test_nested_image_parts_are_not_read():
    nested = {"content": [{"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]}
    out, sources = extract_images(request(state=[nested, "text"]))
    assert out["state"] == [nested, "text"] and sources == []


def test_input_image_with_url_object_and_top_level_parts_are_accepted():
    raw = request(
        images=[{"type": "image_url", "image_url": {"url": data_url(b"top")}}],
        state=[{"type": "input_image", "image_url": {"url": data_url(b"state")}}, "t"],
    )
    out, sources = extract_images(raw)
    assert [s.data for s in sources] == [b"top", b"state"]
    assert out["state"] == "t"


def test_top_level_images_come_before_state_images():
    raw = request(
        state=[{"type": "image_url", "image_url": {"url": data_url(b"s0")}}, "t"],
        images=[data_url(b"i0"), data_url(b"i1")],
    )
    _, sources = extract_images(raw)
    assert [(s.data, s.loc) for s in sources] == [
        (b"i0", ("images", 0)),
        (b"i1", ("images", 1)),
        (b"s0", ("state", 0)),
    ]


def test_limits_at_the_boundary_are_accepted():
    exactly = bytes(MAX_IMAGE_BYTES)
    _, sources = extract_images(request(images=[data_url(exactly), data_url(exactly)]))
    assert [len(s.data) for s in sources] == [MAX_IMAGE_BYTES, MAX_IMAGE_BYTES]
    _, sources = extract_images(request(images=[data_url(b"x")] * MAX_IMAGES))
    assert len(sources) == MAX_IMAGES


def test_non_dict_request_is_passed_through():
    assert extract_images([1, 2]) == ([1, 2], [])


def test_normalize_content_type():
    assert normalize_content_type(" Image/JPG ; q=1") == "image/jpeg"
    assert normalize_content_type("image/png") == "image/png"
    assert normalize_content_type("image/gif") is None


# --- errors ---------------------------------------------------------------------------------------------


def test_five_images_name_the_fifth():
    errs = errors_of(request(images=[data_url(b"x")] * 5))
    assert errs == [
        {"loc": ("images", 4), "msg": "at most 4 images per request, got 5", "type": "too_many_images"}
    ]


def test_five_images_across_both_forms_name_the_first_over_the_limit():
    state = ["t", *({"type": "image_url", "image_url": {"url": data_url(b"s")}} for _ in range(2))]
    errs = errors_of(request(images=[data_url(b"x")] * 3, state=state))
    assert [e["loc"] for e in errs] == [("state", 2)]
    assert errs[0]["type"] == "too_many_images"


def test_too_many_images_are_refused_without_decoding(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("base64 must not be decoded")

    monkeypatch.setattr(images_module.base64, "b64decode", forbidden)
    assert errors_of(request(images=[data_url(b"x")] * 6))[0]["type"] == "too_many_images"
    errs = errors_of(request(images=[data_url(bytes(MAX_IMAGE_BYTES + 1))]))
    assert errs[0]["type"] == "image_too_large"


def test_one_byte_over_4_mib_is_refused():
    errs = errors_of(request(images=[data_url(b"ok"), data_url(bytes(MAX_IMAGE_BYTES + 1))]))
    assert [(e["loc"], e["type"]) for e in errs] == [(("images", 1), "image_too_large")]


@pytest.mark.parametrize("pad_bytes", [MAX_IMAGE_BYTES + 1, MAX_IMAGE_BYTES + 2, MAX_IMAGE_BYTES + 3])
def test_decoded_size_is_computed_exactly_from_base64_length(pad_bytes):
    errs = errors_of(request(images=[{"content_type": "image/png", "base64": b64(bytes(pad_bytes))}]))
    assert errs[0]["type"] == "image_too_large"


def test_total_over_8_mib_names_the_image_that_crosses():
    three_mib = bytes(3 * 1024 * 1024)
    errs = errors_of(request(images=[data_url(three_mib)] * 3))
    assert [(e["loc"], e["type"]) for e in errs] == [(("images", 2), "images_too_large")]
    assert 3 * len(three_mib) > MAX_TOTAL_IMAGE_BYTES


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/cat.png",
        "http://example.com/cat.png",
        "HTTPS://EXAMPLE.COM/cat.png",
        "ftp://example.com/cat.png",
        "file:///etc/passwd",
        "iVBORw0KGgo=",
        "/tmp/cat.png",
    ],
)
def test_non_data_urls_are_refused(url):
    errs = errors_of(request(images=[url]))
    assert [(e["loc"], e["type"]) for e in errs] == [(("images", 0), "image_url_not_allowed")]


def test_remote_url_in_state_names_the_state_item():
    state = ["t", {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]
    errs = errors_of(request(state=state))
    assert [(e["loc"], e["type"]) for e in errs] == [(("state", 1), "image_url_not_allowed")]


@pytest.mark.parametrize("payload", ["not base64!!", "YWJjZA=a", "Y", "YW Jj\x00ZA==", "ÿÿÿÿ"])
def test_bad_base64_is_refused(payload):
    errs = errors_of(request(images=[f"data:image/png;base64,{payload}"]))
    assert [(e["loc"], e["type"]) for e in errs] == [(("images", 0), "invalid_base64")]


def test_empty_data_is_refused():
    errs = errors_of(request(images=["data:image/png;base64,"]))
    assert errs[0]["type"] == "invalid_base64"


@pytest.mark.parametrize("content_type", ["image/gif", "image/bmp", "text/plain", "", "image/svg+xml"])
def test_unsupported_content_types_are_refused(content_type):
    errs = errors_of(request(images=[f"data:{content_type};base64,{b64(b'x')}"]))
    assert errs[0]["type"] == "unsupported_media_type" and errs[0]["loc"] == ("images", 0)
    errs = errors_of(request(images=[{"content_type": content_type, "base64": b64(b"x")}]))
    assert errs[0]["type"] == "unsupported_media_type"


@pytest.mark.parametrize(
    ("item", "type_"),
    [
        ("data:image/png,rawbytes", "invalid_data_url"),
        ("data:image/png;base64", "invalid_data_url"),
        ({"base64": "eA=="}, "missing"),
        ({"content_type": "image/png"}, "missing"),
        ({"type": "image_url"}, "missing"),
        ({"type": "input_image", "file_id": "file-123"}, "image_type"),
        (42, "image_type"),
        (None, "image_type"),
    ],
)
def test_malformed_items_are_refused(item, type_):
    errs = errors_of(request(images=[item]))
    assert [(e["loc"], e["type"]) for e in errs] == [(("images", 0), type_)]


def test_images_must_be_a_list():
    errs = errors_of(request(images="data:image/png;base64,eA=="))
    assert [(e["loc"], e["type"]) for e in errs] == [(("images",), "images_type")]


def test_every_bad_image_is_reported():
    errs = errors_of(request(images=["https://x/y.png", data_url(b"fine"), "data:image/gif;base64,eA=="]))
    assert [(e["loc"], e["type"]) for e in errs] == [
        (("images", 0), "image_url_not_allowed"),
        (("images", 2), "unsupported_media_type"),
    ]
    assert all(isinstance(e["msg"], str) and e["msg"] for e in errs)


def test_image_source_repr_does_not_dump_the_bytes():
    source = ImageSource(bytes(10_000), "image/png", ("images", 0))
    assert len(repr(source)) < 100


# --- parse_with_images ----------------------------------------------------------------------------------


def test_parse_with_images_parses_the_request_without_its_images():
    parsed, sources = parse_with_images(request(images=[data_url(b"cat")]))
    assert isinstance(parsed, SystemOneRequest)
    assert parsed.state == "text"
    assert [source.data for source in sources] == [b"cat"]


def test_parse_with_images_takes_a_parsed_request_as_it_is():
    parsed, _ = parse_with_images(request())
    assert parse_with_images(parsed) == (parsed, [])


def test_parse_with_images_names_a_bad_image_and_a_bad_field():
    with pytest.raises(RequestValidationError) as bad_image:
        parse_with_images(request(images=["https://example.com/cat.png"]))
    assert bad_image.value.errors[0]["loc"] == ("images", 0)
    with pytest.raises(RequestValidationError) as bad_field:
        parse_with_images(request(questions={}))
    assert bad_field.value.errors[0]["loc"][0] == "questions"
