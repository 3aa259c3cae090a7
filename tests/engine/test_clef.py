"""End to end on the tiny model: `Clef.load` -> `decide` / `decide_encoded`, and the `clef decide` CLI."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import clef_runtime.encoding.tokenizer as tokenizer_module
import clef_runtime.model.checkpoint as checkpoint_module
from clef_runtime import Clef
from clef_runtime.engine.clef import PreparedRequest
from clef_runtime.model.backbone import TRANSFORMERS_CONSTRUCTION_LOCK, Backbone
from clef_runtime.model.checkpoint import CheckpointError
from clef_runtime.model.resolve import resolve_model
from clef_runtime.protocol.errors import InputTooLongError, RequestValidationError
from clef_runtime.vision.tower import VisionTower
from tests.helpers import png_data_url as png_url
from tests.helpers import run_cli_process as run_cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE: dict[str, Any] = json.loads((ROOT / "examples" / "request.json").read_text())

REQUESTS: list[dict[str, Any]] = [
    EXAMPLE,
    {"state": "short", "questions": {"only": {"type": "noul", "criteria": {"false": "no way"}}}},
    {
        "model": "jev-latest",
        "state": {"log": ["error " * 40, {"code": 500}], "long": "x " * 300},
        "questions": {
            "sev": {"type": "score", "criteria": ["none", "low", "mid", "high", {"level": "critical"}]},
            "kind": {"type": "choice", "criteria": {f"k{i}": f"kind {i}" for i in range(7)}},
            "real": {"type": "noul", "instructions": {"ask": "is this a real incident?"}},
        },
    },
]


@pytest.fixture(scope="module")
def clef() -> Clef:
    return Clef.load("tiny", dtype="fp32")


def check_response(request: dict[str, Any], response: dict[str, Any], input_tokens: int) -> None:
    assert set(response) == {"model", "answers", "usage", "x_state_cache", "x_head"}
    assert response["model"] == request.get("model", "tiny")
    assert response["x_head"]["name"] == "tiny"  # the default head answers any model name
    cached = response["usage"]["input_tokens_details"]["cached_tokens"]
    assert response["usage"] == {
        "input_tokens": input_tokens,
        "output_tokens": 0,
        "input_tokens_details": {"cached_tokens": cached},
    }
    # Whether the state came from the cache depends on what ran before; the report is consistent with it.
    assert (response["x_state_cache"] == "miss") == (cached == 0) or response["x_state_cache"] == "hit"
    assert 0 <= cached < input_tokens
    assert list(response["answers"]) == list(request["questions"])  # request order
    for qid, answer in response["answers"].items():
        question = request["questions"][qid]
        assert answer["type"] == question["type"]
        if question["type"] == "noul":
            assert set(answer) == {"type", "noul"}
            assert 0.0 <= answer["noul"] <= 1.0
            continue
        probs = answer["probabilities"]
        # Each rounded probability is off by at most 5e-5.
        assert abs(sum(probs.values()) - 1.0) <= 5e-5 * len(probs) + 1e-9
        assert answer["confidence"] == max(probs.values())
        if question["type"] == "choice":
            assert list(probs) == [str(k) for k in question["criteria"]]
            assert probs[answer["choice"]] == max(probs.values())
        else:
            assert list(probs) == [str(i) for i in range(len(question["criteria"]))]
            expected = sum(i * p for i, p in enumerate(probs.values()))
            assert math.isclose(answer["score"], expected, abs_tol=5e-5 * len(probs) ** 2)
            assert answer["legend"] == {str(i): c for i, c in enumerate(question["criteria"])}


@pytest.mark.parametrize("index", range(len(REQUESTS)))
def test_decide_shapes(clef: Clef, index: int) -> None:
    request = REQUESTS[index]
    response = clef.decide(request)
    check_response(request, response, clef.encode(request).input_tokens)


def test_tiny_is_described_as_untrained(clef: Clef) -> None:
    assert clef.card.model.untrained
    assert "untrained" in clef.card.model.description.lower()


@pytest.mark.slow
def test_requests_do_not_affect_each_other(clef: Clef) -> None:
    def answered(response: dict[str, Any]) -> tuple[Any, Any]:
        # What a request asked for; whether its state was cached depends on what ran before it.
        return response["answers"], response["usage"]["input_tokens"]

    alone = [answered(clef.decide(r)) for r in REQUESTS]
    # long, short, long again, in a row
    in_a_row = [answered(clef.decide(REQUESTS[i])) for i in (2, 1, 2)]
    assert in_a_row[0] == alone[2]
    assert in_a_row[1] == alone[1]
    assert in_a_row[2] == alone[2]


def flatten(response: dict[str, Any]) -> dict[str, float]:
    out = {}
    for qid, answer in response["answers"].items():
        if answer["type"] == "noul":
            out[qid] = answer["noul"]
        else:
            for k, p in answer["probabilities"].items():
                out[f"{qid}/{k}"] = p
    return out


def test_batch_equals_single(clef: Clef) -> None:
    items = [(clef.parse(r), clef.encode(r)) for r in REQUESTS]
    batched = clef.decide_many(items)
    assert clef.last_timings.batch_size == len(REQUESTS)
    for request, response in zip(REQUESTS, batched, strict=True):
        single = clef.decide(request)
        a, b = flatten(response), flatten(single)
        assert a.keys() == b.keys()
        # 1e-4 on the probabilities, plus one unit of the 4th decimal for rounding.
        assert max(abs(a[k] - b[k]) for k in a) <= 2e-4


def test_backbone_token_counter_counts_real_work(clef: Clef) -> None:
    body = {"state": "a state seen only by this test", "questions": REQUESTS[1]["questions"]}
    record = clef.encode(body)
    before = clef.backbone_tokens
    clef.decide(body)
    # Cold: everything but the 36-token prompt prefix, which is always cached.
    assert clef.backbone_tokens - before == record.input_tokens - clef.prefix_state.length
    assert clef.last_timings.backbone_tokens == record.input_tokens - 36
    before = clef.backbone_tokens
    clef.decide(body)
    # Again: the state is cached, only the schema and suffix run.
    assert clef.backbone_tokens - before == record.input_tokens - record.state_end


def test_invalid_request_raises_validation_error(clef: Clef) -> None:
    with pytest.raises(RequestValidationError) as info:
        clef.decide({"state": "s", "questions": {"q": {"type": "choice", "criteria": ["a", "b"]}}})
    assert info.value.errors[0]["loc"] == ("questions", "q", "criteria")


@pytest.mark.parametrize(
    ("state", "loc"),
    [
        ("\ud800", ("state",)),
        ({"n": float("inf")}, ("state", "n")),
        ({"k": [float("nan")]}, ("state", "k", 0)),
    ],
)
def test_text_or_numbers_the_model_cannot_take_are_refused_before_any_work(
    clef: Clef, state: Any, loc: tuple[Any, ...]
) -> None:
    before = clef.backbone_tokens
    with pytest.raises(RequestValidationError) as info:
        clef.decide({"state": state, "questions": {"q": {"type": "noul"}}})
    assert [e["loc"] for e in info.value.errors] == [loc]
    assert clef.backbone_tokens == before


@pytest.mark.slow
def answers_only(response: dict[str, Any]) -> dict[str, Any]:
    """A response without the state-cache report (which depends on what the engine ran before)."""
    usage = {k: v for k, v in response["usage"].items() if k != "input_tokens_details"}
    return {**{k: v for k, v in response.items() if k != "x_state_cache"}, "usage": usage}


def test_cli_decide_and_jsonl(clef: Clef) -> None:
    done = run_cli("decide", "--model", "tiny", "-", stdin=json.dumps(REQUESTS[1]))
    assert done.returncode == 0, done.stderr
    assert answers_only(json.loads(done.stdout)) == answers_only(clef.decide(REQUESTS[1]))
    assert "untrained" in done.stderr

    lines = [json.dumps(REQUESTS[1]), '{"state": 3, "questions": {}}', json.dumps(REQUESTS[0])]
    done = run_cli("decide", "--model", "tiny", "--jsonl", stdin="\n".join(lines) + "\n")
    assert done.returncode == 2
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(out) == 3
    assert answers_only(out[0]) == answers_only(clef.decide(REQUESTS[1]))
    assert out[1]["error"]["detail"][0]["loc"] == ["state"]
    assert answers_only(out[2]) == answers_only(clef.decide(REQUESTS[0]))


def linked_tiny_copy(directory: Path) -> Path:
    """``directory`` filled with links to the tiny checkpoint's files (replace one to damage it)."""
    for file in resolve_model("tiny").path.iterdir():
        (directory / file.name).symlink_to(file)
    return directory


def test_load_parses_tokenizer_json_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str] = []
    read_json: list[str] = []
    real_parse, real_read = tokenizer_module._parse_tokenizer_json, checkpoint_module._read_json_object
    monkeypatch.setattr(tokenizer_module, "_parsed", {})  # nothing parsed yet in this process
    monkeypatch.setattr(
        tokenizer_module,
        "_parse_tokenizer_json",
        lambda text, source: parsed.append(source) or real_parse(text, source),
    )
    monkeypatch.setattr(
        checkpoint_module, "_read_json_object", lambda path: read_json.append(path.name) or real_read(path)
    )
    directory = linked_tiny_copy(tmp_path)
    Clef.load(str(directory), dtype="fp32")
    assert parsed == [str(directory / "tokenizer.json")]  # by the tokenizer
    assert "tokenizer.json" not in read_json and "config.json" in read_json  # not again by verify_checkpoint
    Clef.load(str(directory), dtype="fp32")
    assert len(parsed) == 1  # a second engine in this process shares the parse


def test_a_malformed_tokenizer_json_stops_the_load_before_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = linked_tiny_copy(tmp_path)
    (directory / "tokenizer.json").unlink()
    (directory / "tokenizer.json").write_text('{"model": ')

    def no_weights(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the weights were loaded before the tokenizer was checked")

    monkeypatch.setattr(Backbone, "load", no_weights)
    with pytest.raises(CheckpointError) as raised:
        Clef.load(str(directory), dtype="fp32")
    assert raised.value.file == directory / "tokenizer.json"
    assert str(directory / "tokenizer.json") in str(raised.value)


@pytest.mark.slow
def test_cli_decide_invalid_exits_2_naming_the_field() -> None:
    bad = {"state": "s", "questions": {"q": {"type": "score", "criteria": {"0": "a"}}}}
    done = run_cli("decide", "--model", "tiny", "-", stdin=json.dumps(bad))
    assert done.returncode == 2
    assert "questions.q.criteria" in done.stderr.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------------ images

IMAGE_QUESTIONS: dict[str, Any] = {
    "kind": {"type": "choice", "criteria": {"chart": "a chart", "photo": "a photo", "text": None}},
    "busy": {"type": "noul", "instructions": "Is the picture busy?"},
    "quality": {"type": "score", "criteria": ["bad", "ok", "good"]},
}


# Different sizes give different grids (upscaled to at least 65,536 px): 10x7, 12x6, 8x8, 4x16 merged tokens.
IMAGES = [png_url(64, 48, 1), png_url(400, 200, 2), png_url(256, 256, 3), png_url(128, 512, 4)]


def cloudflare_form(text: str, images: list[str]) -> dict[str, Any]:
    return {"state": text, "images": images, "questions": IMAGE_QUESTIONS}


def openrouter_form(text: str, images: list[str]) -> dict[str, Any]:
    parts: list[Any] = [text] + [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return {"state": parts, "questions": IMAGE_QUESTIONS}


def variant(base: Clef, *, cache_bytes: int = 0, own_tower: bool = False, **options: Any) -> Clef:
    """Another engine on the same loaded weights with its own state cache; it shares ``base``'s vision
    tower unless ``own_tower`` (then a fresh, unloaded one)."""
    model = base.model
    if own_tower:
        tower = VisionTower(base.path, device=base.backbone.device, dtype=base.backbone.dtype)
        model = dataclasses.replace(model, vision_tower=tower)
    return Clef(model, base.options.replace(cache_mb=cache_bytes / 2**20, **options))


def max_prob_diff(a: list[list[list[float]]], b: list[list[list[float]]]) -> float:
    x = [p for item in a for question in item for p in question]
    y = [p for item in b for question in item for p in question]
    assert len(x) == len(y)
    return max(abs(p - q) for p, q in zip(x, y, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 4])
def test_images_end_to_end_in_both_request_forms(clef: Clef, count: int) -> None:
    text = f"what is in these {count} pictures?"
    cloudflare, openrouter = cloudflare_form(text, IMAGES[:count]), openrouter_form(text, IMAGES[:count])
    a, b = clef.prepare(cloudflare), clef.prepare(openrouter)
    assert a.record.input_ids == b.record.input_ids
    assert len(a.record.image_blocks) == count
    assert [n for _, n in a.record.image_blocks] == [70, 72, 64, 64][:count]
    assert a.state_key == b.state_key
    fresh = variant(clef, cache_bytes=0)  # both forms computed from scratch
    first, second = fresh.decide(cloudflare), fresh.decide(openrouter)
    assert first == second
    check_response(cloudflare, first, a.input_tokens)
    assert fresh.last_timings.backbone_tokens == a.input_tokens - 36
    # The answer depends on the images: without them it differs.
    no_images = fresh.probabilities_encoded([fresh.prepare({"state": text, "questions": IMAGE_QUESTIONS})])
    assert max_prob_diff(fresh.probabilities_encoded([a]), no_images) > 1e-4


def load_multimodal_oracle(directory: Path) -> Any:
    """transformers' own Qwen3_5Model (vision tower + merge + get_rope_index + text model) with the
    checkpoint's weights, fp32."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    config = Qwen3_5Config.from_dict(json.loads((directory / "config.json").read_text()))
    config.text_config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    with TRANSFORMERS_CONSTRUCTION_LOCK:
        model = Qwen3_5Model(config).float().eval()
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    state = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(directory / shard), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.startswith("model."):
                    state[name[len("model.") :]] = reader.get_tensor(name).float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    return model


@pytest.mark.slow
def test_image_rows_match_transformers_multimodal_model(clef: Clef) -> None:
    oracle = load_multimodal_oracle(clef.path)
    prepared = clef.prepare(cloudflare_form("three pictures " * 5, IMAGES[:3]))
    ids = torch.tensor([prepared.record.input_ids])
    with torch.inference_mode():
        expected = oracle(
            input_ids=ids,
            pixel_values=torch.cat([image.pixels.pixel_values for image in prepared.images]),
            image_grid_thw=torch.tensor([image.pixels.grid_thw for image in prepared.images]),
            mm_token_type_ids=(ids == 248_056).int(),
        ).last_hidden_state[0]
    engine = variant(clef, cache_bytes=1 << 26)
    cold = engine.hidden_rows([prepared])[0]
    hit = engine.hidden_rows([prepared])[0]
    assert engine.last_timings.state_hits == 1
    assert (cold - expected).abs().max().item() <= 1e-4
    assert (hit - expected).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_text_after_an_image_equals_a_fresh_engine(clef: Clef) -> None:
    text_body = {"state": "plain text after pictures", "questions": IMAGE_QUESTIONS}
    clef.decide(cloudflare_form("pictures first", IMAGES[:2]))
    after = clef.probabilities_encoded([clef.prepare(text_body)])
    fresh = Clef.load("tiny", dtype="fp32", cache_mb=64)  # the same settings as `clef`, nothing run before
    assert fresh.probabilities_encoded([fresh.prepare(text_body)]) == after
    assert not fresh.vision_tower.loaded


@pytest.mark.slow
def test_chunked_prefill_with_an_image_equals_full(clef: Clef) -> None:
    prepared = clef.prepare(cloudflare_form("chunk me " * 10, IMAGES[:2]))
    full = variant(clef)
    chunked = variant(clef, prefill_chunk=32)
    seed_form = variant(clef, prefill_chunk=64, pad_last_chunk=True)
    assert (chunked.hidden_rows([prepared])[0] - full.hidden_rows([prepared])[0]).abs().max().item() <= 1e-4
    reference = full.probabilities_encoded([prepared])
    assert max_prob_diff(chunked.probabilities_encoded([prepared]), reference) <= 1e-4
    assert max_prob_diff(seed_form.probabilities_encoded([prepared]), reference) <= 1e-4
    assert seed_form.last_timings.backbone_tokens == prepared.input_tokens  # the seed form caches nothing


@pytest.mark.slow
def test_mixed_image_and_text_batch_equals_singles(clef: Clef) -> None:
    bodies = [
        cloudflare_form("first", IMAGES[:1]),
        REQUESTS[1],
        cloudflare_form("second, with more text " * 4, IMAGES[1:4]),
        {"state": "text only", "questions": IMAGE_QUESTIONS},
    ]
    engine = variant(clef)
    prepared = [engine.prepare(body) for body in bodies]
    together = engine.probabilities_encoded(prepared)
    assert engine.last_timings.batch_size == 4 and engine.last_timings.state_misses == 4
    singles = [variant(clef).probabilities_encoded([item])[0] for item in prepared]
    assert max_prob_diff(together, singles) <= 1e-4


def test_text_requests_never_load_the_vision_tower(clef: Clef) -> None:
    engine = variant(clef, cache_bytes=1 << 26, own_tower=True)
    for body in REQUESTS:
        engine.decide(body)
    engine.decide_many([(engine.parse(REQUESTS[0]), engine.encode(REQUESTS[0]))])
    assert engine.vision_tower.loaded is False
    engine.decide(cloudflare_form("now a picture", IMAGES[:1]))
    assert engine.vision_tower.loaded is True


def test_image_items_must_carry_their_images(clef: Clef) -> None:
    body = cloudflare_form("x", IMAGES[:1])
    parsed = clef.parse(body)  # the images are taken out: they are not part of SystemOneRequest
    record = clef.encode(body)
    assert record.image_blocks
    with pytest.raises(ValueError, match=r"Clef\.prepare"):
        clef.decide_many([(parsed, record)])
    prepared = clef.prepare(body)
    assert isinstance(prepared, PreparedRequest)
    first, again = clef.decide_many([(parsed, prepared)]), clef.decide_many([prepared])
    assert answers_only(first[0]) == answers_only(again[0])
    assert again[0]["x_state_cache"] == "hit"  # the same state: the second came from the cache


def test_image_errors_are_validation_errors(clef: Clef) -> None:
    remote = {"state": "s", "images": ["https://example.com/a.png"], "questions": IMAGE_QUESTIONS}
    with pytest.raises(RequestValidationError) as info:
        clef.prepare(remote)
    assert info.value.errors[0]["loc"] == ("images", 0)
    broken = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nbroken").decode()
    with pytest.raises(RequestValidationError) as info:
        clef.decide(openrouter_form("s", [IMAGES[0], broken]))
    assert info.value.errors[0]["loc"] == ("state", 2)
    with pytest.raises(InputTooLongError):
        clef.prepare(cloudflare_form("s", IMAGES), max_length=200)


@pytest.mark.slow
def test_image_modes(clef: Clef) -> None:
    body = cloudflare_form("tiles", IMAGES[:2])
    g256 = variant(clef, image_mode="g256")
    assert [n for _, n in g256.encode(body).image_blocks] == [64, 64]
    assert [n for _, n in variant(clef, image_mode="g448").encode(body).image_blocks] == [196, 196]
    capped = variant(clef, image_max_tokens=200)
    big = cloudflare_form("big", [png_url(1200, 900, 5)])
    assert sum(n for _, n in capped.encode(big).image_blocks) <= 200
    check_response(body, g256.decide(body), g256.encode(body).input_tokens)
    with pytest.raises(ValueError, match=r"image.mode"):
        Clef.load("tiny", image_mode="g999")


def test_model_compute_does_not_leak_flush_to_zero_into_request_handling(clef: Clef) -> None:
    # The backbone flushes denormals to zero for speed; request parsing must keep IEEE semantics, or a
    # subnormal number in a state would be rendered as 0.0 and the prompt would differ from the reference's.
    clef.decide(REQUESTS[1])
    request = json.loads('{"state": {"tiny": 1e-310}, "questions": {"q": {"type": "noul"}}}')
    assert request["state"]["tiny"] != 0.0
    ids = clef.encode(request).input_ids
    assert clef.tokenizer.decode(ids).count("1e-310") == 1


def test_release_dates_follow_the_release(tiny: Clef) -> None:
    """Clef-flash's date is published; the 27B's is not, so /v1/models says unknown rather than the 9B's."""
    import dataclasses

    from clef_runtime.options import EngineOptions

    def as_release(name: str) -> Clef:
        resolved = dataclasses.replace(tiny.model.resolved, name=name, is_tiny=False)
        return Clef(dataclasses.replace(tiny.model, resolved=resolved), EngineOptions(cache_mb=0))

    assert as_release("Cloudflare/clef-flash").card.model.release_date == "2026-10-01"
    assert as_release("Cloudflare/clef").card.model.release_date is None
    assert tiny.card.model.release_date == "2026-11-29"
