"""Clef's joint schema head (docs/model.md section 6), our own vectorised PyTorch implementation.

The module tree reproduces the release's parameter names and shapes exactly (122 tensors for the release
config) so that `joint_head.safetensors` loads with `load_state_dict(strict=True)`. The torch modules only
*hold* parameters; the forward pass is written here with functional ops and always runs in fp32.

One forward (`_logits`) serves scoring (`score_batch`, under inference mode) and tuning (`training_logits`,
with autograd; `option_features` + `option_logits` split it before the residual scorer, the last step that
has parameters besides the three scalars). `save_files` writes a head back in the release layout.

Batching: token-wise work (LayerNorm of the hidden rows, the memory projection and every key/value
projection) runs on the records' rows packed end to end, so records of different lengths waste nothing
there. Attention and routing run on records padded to a common T / Q / O with boolean masks (keys of
padded tokens and padded questions are masked; padded query rows are computed and dropped).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import safetensors
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from clef_runtime.encoding.encoder import QUESTION_TYPE_IDS
from clef_runtime.model.load_errors import ModelLoadError
from clef_runtime.release import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE

LAYER_NORM_EPS = 1e-5
NORMALIZE_EPS = 1e-12
COSINE_EPS = 1e-8
#: The reference caps the two logit scales as `exp(min(param, ln 100))`.
LOGIT_SCALE_CAP_LOG = math.log(100.0)

_CONFIG_KEYS = ("hidden_size", "width", "routing_layers", "layers", "heads", "feedforward")
_OPTIONAL_CONFIG_KEYS = ("dropout",)

#: Hidden rows are LayerNormed and projected to memory in blocks of this many rows, so a long record
#: never needs an fp32 copy of its whole [T, hidden_size] hidden state.
DEFAULT_MEMORY_CHUNK_ROWS = 2048


class HeadLoadError(ModelLoadError, ValueError):
    """The head's config or weights file is missing, malformed, or does not match the module.

    `path` is the offending file; `tensor_names` lists the offending tensors (empty for config errors).
    """

    def __init__(self, path: str | Path, message: str, tensor_names: Sequence[str] = ()) -> None:
        self.path = Path(path)
        self.tensor_names = tuple(tensor_names)
        super().__init__(f"{self.path}: {message}")


@dataclass(frozen=True)
class HeadLayout:
    """Where the head reads one record: its questions, in request order, and their options.

    `type_ids[q]` is the question's type (noul 0, choice 1, score 2); `question_spans[q]` and every
    `option_spans[q][k]` are `[start, end)` token ranges into the record's tokens. Options are flattened
    in question order wherever a per-option tensor is involved.
    """

    type_ids: Sequence[int]
    question_spans: Sequence[tuple[int, int]]
    option_spans: Sequence[Sequence[tuple[int, int]]]

    @property
    def num_questions(self) -> int:
        """Returns the number of questions."""
        return len(self.type_ids)

    @property
    def option_counts(self) -> list[int]:
        """Returns the number of options of each question, in question order."""
        return [len(spans) for spans in self.option_spans]

    @property
    def num_options(self) -> int:
        """Returns the total number of options over all questions."""
        return sum(self.option_counts)

    def validate(self, num_tokens: int) -> None:
        """Checks the layout against a record of `num_tokens` tokens.

        Raises ValueError if the three per-question sequences differ in length, there is no question, a
        question has no option, a type id is not 0/1/2, or a span is empty or outside `[0, num_tokens)`
        (the reference would average over an empty span and return NaN).
        """
        if not (len(self.type_ids) == len(self.question_spans) == len(self.option_spans)):
            raise ValueError(
                "layout: type_ids, question_spans and option_spans must have one entry per question "
                f"(got {len(self.type_ids)}, {len(self.question_spans)}, {len(self.option_spans)})"
            )
        if not self.type_ids:
            raise ValueError("layout: a record needs at least one question")
        for question, type_id in enumerate(self.type_ids):
            if type_id not in (0, 1, 2):
                raise ValueError(f"layout: question {question} has type id {type_id!r}, expected 0, 1 or 2")
            _check_span(self.question_spans[question], num_tokens, f"question {question}")
            if not self.option_spans[question]:
                raise ValueError(f"layout: question {question} has no options")
            for option, span in enumerate(self.option_spans[question]):
                _check_span(span, num_tokens, f"question {question} option {option}")


def _check_span(span: tuple[int, int], num_tokens: int, what: str) -> None:
    start, end = span
    if not (0 <= start < end <= num_tokens):
        raise ValueError(
            f"layout: {what} span [{start}, {end}) is empty or outside the record's {num_tokens} tokens"
        )


def probabilities(logits: Tensor, layout: HeadLayout) -> list[Tensor]:
    """Returns the per-question fp32 softmax over that question's options (no temperature).

    `logits` is the [O] tensor returned by `JointSchemaHead.score` for `layout`. Raises ValueError if its
    shape does not match the layout.
    """
    counts = layout.option_counts
    if logits.dim() != 1 or logits.shape[0] != sum(counts):
        raise ValueError(f"probabilities: logits of shape {tuple(logits.shape)} for {sum(counts)} options")
    return [part.softmax(-1) for part in torch.split(logits.float(), counts)]


def read_head_config(path: str | Path) -> dict[str, Any]:
    """Reads `joint_head_config.json` and returns the `JointSchemaHead` constructor kwargs.

    Raises HeadLoadError (naming the file) if it is missing, not JSON, not an object, lacks a key, has an
    unknown key, or holds a value of the wrong type or range.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise HeadLoadError(path, "head config file not found") from error
    except (OSError, UnicodeDecodeError) as error:
        raise HeadLoadError(path, f"cannot read the head config: {error}") from error
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise HeadLoadError(path, f"head config is not valid JSON: {error}") from error
    if not isinstance(raw, dict):
        raise HeadLoadError(path, f"head config must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_CONFIG_KEYS) - set(_OPTIONAL_CONFIG_KEYS))
    if unknown:
        raise HeadLoadError(path, f"unknown head config keys: {', '.join(unknown)}")
    missing = [key for key in _CONFIG_KEYS if key not in raw]
    if missing:
        raise HeadLoadError(path, f"head config lacks keys: {', '.join(missing)}")
    for key in _CONFIG_KEYS:
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise HeadLoadError(path, f"head config {key} must be a positive integer, got {value!r}")
    if "dropout" in raw:
        dropout = raw["dropout"]
        if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
            raise HeadLoadError(path, f"head config dropout must be a number in [0, 1), got {dropout!r}")
    if raw["width"] % raw["heads"] != 0:
        raise HeadLoadError(
            path, f"head config width {raw['width']} is not divisible by heads {raw['heads']}"
        )
    return dict(raw)


def _read_head_tensors(path: Path) -> dict[str, Tensor]:
    """Reads every tensor of a safetensors file (CPU, stored dtype). Raises HeadLoadError."""
    if not path.is_file():
        raise HeadLoadError(path, "head weights file not found")
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as reader:
            return {name: reader.get_tensor(name) for name in reader.keys()}  # noqa: SIM118
    except (OSError, safetensors.SafetensorError) as error:
        raise HeadLoadError(path, f"cannot read the head weights: {error}") from error


class _EvidenceLayer(nn.Module):
    """Parameter holder for one evidence-routing layer (options attend to the memory only)."""

    def __init__(self, width: int, heads: int, feedforward: int, dropout: float) -> None:
        super().__init__()
        self.query_norm = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.memory_norm = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.feedforward_norm = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        # Index positions 0 and 3 carry the weights, as in the release's Sequential.
        self.feedforward = nn.Sequential(
            nn.Linear(width, feedforward),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(feedforward, width),
            nn.Dropout(dropout),
        )


class _FieldDecoderLayer(nn.Module):
    """Parameter holder named like torch's `TransformerDecoderLayer` (norm_first, GELU)."""

    def __init__(self, width: int, heads: int, feedforward: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.multihead_attn = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.linear1 = nn.Linear(width, feedforward)
        self.linear2 = nn.Linear(feedforward, width)
        self.norm1 = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.norm3 = nn.LayerNorm(width, eps=LAYER_NORM_EPS)


@dataclass(frozen=True)
class OptionFeatures:
    """What the head's scoring step reads, packed per option [O, ...] (fp32, on the head's device).

    ``option_fields``: each option's owning field after joint decoding (LN'd); ``option_rows``: the option's
    routed row (LN'd); ``lexical_prior``: the unscaled lexical prior (the option's lexical direction . its
    question's anchor); ``cosine``: cos(field, row). `JointSchemaHead.option_logits` turns them into logits
    with the residual scorer and the three scalars, the only parameters after this point.
    """

    option_fields: Tensor
    option_rows: Tensor
    lexical_prior: Tensor
    cosine: Tensor

    @property
    def num_options(self) -> int:
        """The number of options (rows)."""
        return int(self.cosine.shape[0])

    def split(self, counts: Sequence[int]) -> list[OptionFeatures]:
        """One `OptionFeatures` per consecutive group of ``counts`` options."""
        parts = [torch.split(value, list(counts)) for value in self.tensors()]
        return [OptionFeatures(*values) for values in zip(*parts, strict=True)]

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The four tensors in field order."""
        return (self.option_fields, self.option_rows, self.lexical_prior, self.cosine)

    @staticmethod
    def cat(parts: Sequence[OptionFeatures]) -> OptionFeatures:
        """The options of ``parts`` end to end."""
        return OptionFeatures(
            *(torch.cat(values) for values in zip(*(p.tensors() for p in parts), strict=True))
        )


@dataclass(frozen=True)
class _BatchIndex:
    """Index tensors (on the head's device) describing a batch of records for one forward pass.

    "Packed" tensors list the records' items end to end; "slots" map packed items to rows of the padded
    [batch * max_len] layout.
    """

    batch_size: int
    max_tokens: int
    max_questions: int
    max_options: int
    option_counts: list[int]  # per record
    span_rows: Tensor  # [L] packed hidden row of every span token (question spans first, then options)
    span_segments: Tensor  # [L] which span each of those tokens belongs to
    span_lengths: Tensor  # [S] fp32 number of tokens per span; S = questions + options
    last_token_rows: Tensor  # [B] packed row of each record's last token (the global vector)
    question_types: Tensor  # [Qp]
    question_records: Tensor  # [Qp]
    option_owners: Tensor  # [Op] packed index of the question owning each option
    token_slots: Tensor  # [Tp]
    question_slots: Tensor  # [Qp]
    option_slots: Tensor  # [Op]
    token_key_mask: Tensor | None  # [B, 1, 1, max_tokens], True = real token; None when nothing is padded
    question_key_mask: Tensor | None  # [B, 1, 1, max_questions]
    membership: Tensor  # [B, max_questions, max_options], True where the option belongs to the question

    @classmethod
    def build(
        cls, layouts: Sequence[HeadLayout], token_counts: Sequence[int], device: torch.device
    ) -> _BatchIndex:
        """Flattens the layouts into index tensors. Raises ValueError for an invalid layout."""
        for record, (layout, num_tokens) in enumerate(zip(layouts, token_counts, strict=True)):
            try:
                layout.validate(num_tokens)
            except ValueError as error:
                raise ValueError(f"record {record}: {error}") from error
        batch_size = len(layouts)
        question_counts = [layout.num_questions for layout in layouts]
        option_counts = [layout.num_options for layout in layouts]

        # Flattening the Python layout walks every span once; all tensor work below is vectorised.
        token_offsets = [0]
        for num_tokens in token_counts[:-1]:
            token_offsets.append(token_offsets[-1] + num_tokens)
        question_bounds: list[tuple[int, int]] = []
        option_bounds: list[tuple[int, int]] = []
        option_owner_list: list[int] = []
        type_list: list[int] = []
        question_base = 0
        for layout, offset in zip(layouts, token_offsets, strict=True):
            type_list.extend(int(type_id) for type_id in layout.type_ids)
            question_bounds.extend((start + offset, end + offset) for start, end in layout.question_spans)
            for question, spans in enumerate(layout.option_spans):
                option_bounds.extend((start + offset, end + offset) for start, end in spans)
                option_owner_list.extend([question_base + question] * len(spans))
            question_base += layout.num_questions

        def as_long(values: Sequence[int] | Sequence[tuple[int, int]]) -> Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        bounds = as_long(question_bounds + option_bounds).view(-1, 2)
        starts, lengths = bounds[:, 0], bounds[:, 1] - bounds[:, 0]
        num_spans = bounds.shape[0]
        span_segments = torch.repeat_interleave(torch.arange(num_spans, device=device), lengths)
        first_position = torch.cumsum(lengths, 0) - lengths
        within_span = torch.arange(span_segments.shape[0], device=device) - first_position[span_segments]
        span_rows = starts[span_segments] + within_span

        token_count_tensor = as_long(token_counts)
        question_count_tensor = as_long(question_counts)
        option_count_tensor = as_long(option_counts)
        max_tokens, max_questions, max_options = max(token_counts), max(question_counts), max(option_counts)
        question_records, question_slots = _slots(question_count_tensor, max_questions)
        option_records, option_slots = _slots(option_count_tensor, max_options)
        _, token_slots = _slots(token_count_tensor, max_tokens)

        option_owners = as_long(option_owner_list)
        question_first = torch.cumsum(question_count_tensor, 0) - question_count_tensor
        owner_local = option_owners - question_first[option_records]
        option_local = option_slots - option_records * max_options
        membership = torch.zeros(batch_size, max_questions, max_options, dtype=torch.bool, device=device)
        membership[option_records, owner_local, option_local] = True

        return cls(
            batch_size=batch_size,
            max_tokens=max_tokens,
            max_questions=max_questions,
            max_options=max_options,
            option_counts=option_counts,
            span_rows=span_rows,
            span_segments=span_segments,
            span_lengths=lengths.to(torch.float32),
            last_token_rows=as_long(token_offsets) + token_count_tensor - 1,
            question_types=as_long(type_list),
            question_records=question_records,
            option_owners=option_owners,
            token_slots=token_slots,
            question_slots=question_slots,
            option_slots=option_slots,
            token_key_mask=_key_mask(token_count_tensor, max_tokens),
            question_key_mask=_key_mask(question_count_tensor, max_questions),
            membership=membership,
        )


def _slots(counts: Tensor, max_count: int) -> tuple[Tensor, Tensor]:
    """Returns (record of each packed item, its flat slot `record * max_count + position`)."""
    records = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
    first = torch.cumsum(counts, 0) - counts
    positions = torch.arange(records.shape[0], device=counts.device) - first[records]
    return records, records * max_count + positions


def _key_mask(counts: Tensor, max_count: int) -> Tensor | None:
    """Returns an SDPA boolean key mask [B, 1, 1, max_count] (True = attend), or None if none is padded."""
    if bool((counts == max_count).all()):
        return None
    positions = torch.arange(max_count, device=counts.device)
    return (positions[None, :] < counts[:, None])[:, None, None, :]


def _pad(rows: Tensor, slots: Tensor, batch_size: int, max_len: int) -> Tensor:
    """Scatters packed rows [N, C] into a zero-padded [batch_size, max_len, C] tensor."""
    if batch_size == 1 and rows.shape[0] == max_len:
        return rows.unsqueeze(0)
    padded = rows.new_zeros(batch_size * max_len, rows.shape[-1])
    padded[slots] = rows
    return padded.view(batch_size, max_len, rows.shape[-1])


def _unpad(padded: Tensor, slots: Tensor) -> Tensor:
    """Gathers the real rows of a padded [B, L, C] tensor back into packed [N, C] order."""
    return padded.reshape(-1, padded.shape[-1])[slots]


def _layer_norm(values: Tensor, norm: nn.LayerNorm) -> Tensor:
    return F.layer_norm(values, (values.shape[-1],), norm.weight, norm.bias, LAYER_NORM_EPS)


def _capped_scale(log_scale: Tensor) -> Tensor:
    return log_scale.clamp(max=LOGIT_SCALE_CAP_LOG).exp()


class JointSchemaHead(nn.Module):
    """Clef's joint schema head: scores every option of every question of a record from backbone rows.

    Constructor kwargs are exactly `joint_head_config.json`'s keys (+ `dropout`, unused at inference).
    Parameters are created in the default dtype; `from_files` loads the release weights as fp32.
    """

    def __init__(
        self,
        hidden_size: int,
        width: int,
        routing_layers: int,
        layers: int,
        heads: int,
        feedforward: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("hidden_size", hidden_size),
            ("width", width),
            ("routing_layers", routing_layers),
            ("layers", layers),
            ("heads", heads),
            ("feedforward", feedforward),
        ):
            if value <= 0:
                raise ValueError(f"JointSchemaHead: {name} must be positive, got {value}")
        if width % heads != 0:
            raise ValueError(f"JointSchemaHead: width {width} is not divisible by heads {heads}")
        self.hidden_size = hidden_size
        self.width = width
        self.heads = heads
        self.head_dim = width // heads
        self._config = {
            "hidden_size": hidden_size,
            "width": width,
            "routing_layers": routing_layers,
            "layers": layers,
            "heads": heads,
            "feedforward": feedforward,
        }
        #: Rows per block when projecting hidden rows to memory (bounds the fp32 working set).
        self.memory_chunk_rows = DEFAULT_MEMORY_CHUNK_ROWS
        #: Set by `recording_attention` only: every memory attention's probabilities, tagged by kind.
        self._attention_log: list[tuple[str, Tensor]] | None = None

        self.hidden_norm = nn.LayerNorm(hidden_size, eps=LAYER_NORM_EPS)
        self.memory_projection = nn.Linear(hidden_size, width, bias=False)
        self.question_projection = nn.Linear(hidden_size, width, bias=False)
        self.option_question_projection = nn.Linear(hidden_size, width, bias=False)
        self.global_projection = nn.Linear(hidden_size, width, bias=False)
        self.option_context_projection = nn.Linear(hidden_size, width, bias=False)
        self.option_lexical_projection = nn.Linear(hidden_size, width, bias=False)
        self.type_embedding = nn.Embedding(len(QUESTION_TYPE_IDS), width)
        self.evidence_layers = nn.ModuleList(
            _EvidenceLayer(width, heads, feedforward, dropout) for _ in range(routing_layers)
        )
        self.option_summary_norm = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.layers = nn.ModuleList(
            _FieldDecoderLayer(width, heads, feedforward, dropout) for _ in range(layers)
        )
        self.field_norm = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.option_norm = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.residual_scorer = nn.Sequential(
            nn.Linear(4 * width, width),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(width, 1),
        )
        self.prior_logit_scale = nn.Parameter(torch.zeros(()))
        self.joint_logit_scale = nn.Parameter(torch.zeros(()))
        self.residual_gate = nn.Parameter(torch.zeros(()))

    @property
    def config(self) -> dict[str, int]:
        """Returns the constructor kwargs (the `joint_head_config.json` keys) of this head."""
        return dict(self._config)

    @property
    def device(self) -> torch.device:
        """Returns the device the head's parameters live on."""
        return self.prior_logit_scale.device

    @classmethod
    def from_files(cls, directory: str | Path, *, device: str | torch.device = "cpu") -> JointSchemaHead:
        """Builds the head from `joint_head_config.json` + `joint_head.safetensors` in `directory`.

        Tensors are read with safetensors (never pickle), cast to fp32 on `device` and loaded strictly.
        Returns the head in eval mode. Raises HeadLoadError (a ValueError naming the file) if the config
        is missing/malformed, the weights file is missing/unreadable, or tensors are missing, unexpected,
        of the wrong shape or not floating point (listing the offending tensor names).
        """
        directory = Path(directory)
        config = read_head_config(directory / HEAD_CONFIG_FILE)
        weights_path = directory / HEAD_WEIGHTS_FILE
        tensors = _read_head_tensors(weights_path)
        with torch.device("meta"):
            head = cls(**config)
        expected = {name: tuple(value.shape) for name, value in head.state_dict().items()}
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        misshapen = sorted(
            name for name in set(expected) & set(tensors) if tuple(tensors[name].shape) != expected[name]
        )
        not_float = sorted(
            name for name in set(expected) & set(tensors) if not tensors[name].is_floating_point()
        )
        if missing or unexpected or misshapen or not_float:
            problems = []
            if missing:
                problems.append(f"missing tensors: {', '.join(missing)}")
            if unexpected:
                problems.append(f"unexpected tensors: {', '.join(unexpected)}")
            if misshapen:
                problems.append(
                    "wrong shapes: "
                    + ", ".join(
                        f"{name} {list(tensors[name].shape)} (expected {list(expected[name])})"
                        for name in misshapen
                    )
                )
            if not_float:
                problems.append(
                    "not floating point: "
                    + ", ".join(f"{name} ({tensors[name].dtype})" for name in not_float)
                )
            raise HeadLoadError(
                weights_path,
                "does not match the head config: " + "; ".join(problems),
                tensor_names=missing + unexpected + misshapen + not_float,
            )
        state = {name: value.to(device=device, dtype=torch.float32) for name, value in tensors.items()}
        head.load_state_dict(state, strict=True, assign=True)
        return head.eval()

    def forward(
        self, hiddens: Sequence[Tensor], layouts: Sequence[HeadLayout], option_lexicals: Sequence[Tensor]
    ) -> list[Tensor]:
        """Same as `score_batch`."""
        return self.score_batch(hiddens, layouts, option_lexicals)

    def score(self, hidden: Tensor, layout: HeadLayout, option_lexical: Tensor) -> Tensor:
        """Scores one record and returns its [O] fp32 option logits, flattened in question order.

        `hidden` [T, hidden_size] holds the backbone's final-norm rows of the record's real tokens (any
        float dtype, any device; cast to fp32 on the head's device block by block). `option_lexical`
        [O, hidden_size] holds each option's mean `lm_head` row (see `LexicalTable`). Raises ValueError for
        mismatched shapes or an invalid layout.
        """
        return self.score_batch([hidden], [layout], [option_lexical])[0]

    def score_batch(
        self, hiddens: Sequence[Tensor], layouts: Sequence[HeadLayout], option_lexicals: Sequence[Tensor]
    ) -> list[Tensor]:
        """Scores several records in one vectorised pass; returns one [O_b] fp32 logits tensor per record.

        Records may differ in tokens, questions and options. Raises ValueError for mismatched lengths or
        shapes or an invalid layout.
        """
        return self._record_logits(hiddens, layouts, option_lexicals, inference=True)

    def training_logits(
        self, hiddens: Sequence[Tensor], layouts: Sequence[HeadLayout], option_lexicals: Sequence[Tensor]
    ) -> list[Tensor]:
        """`score_batch` with autograd: the same forward (`_logits`), outside inference mode, so a loss on
        the returned logits reaches every parameter that requires grad (``clef tune --tier full``).

        Memory is kept for the backward pass, so batches should be smaller than for scoring. Raises like
        `score_batch`.
        """
        return self._record_logits(hiddens, layouts, option_lexicals, inference=False)

    def _record_logits(
        self,
        hiddens: Sequence[Tensor],
        layouts: Sequence[HeadLayout],
        option_lexicals: Sequence[Tensor],
        *,
        inference: bool,
    ) -> list[Tensor]:
        """One [O_b] logits tensor per record; the forward runs in inference mode when ``inference`` (the
        batch index is built outside it either way)."""
        if not hiddens and not layouts and not option_lexicals:
            return []
        index = self._batch_index(hiddens, layouts, option_lexicals)
        with torch.inference_mode() if inference else contextlib.nullcontext():
            hidden_rows, lexical_rows = self._packed_inputs(hiddens, option_lexicals)
            logits = self._logits(hidden_rows, lexical_rows, index)
        return list(torch.split(logits, index.option_counts))

    def option_features(
        self, hiddens: Sequence[Tensor], layouts: Sequence[HeadLayout], option_lexicals: Sequence[Tensor]
    ) -> list[OptionFeatures]:
        """What the scoring step reads, per record (`OptionFeatures`), computed without grad: everything
        of the forward before the residual scorer and the three scalars. `option_logits` of a record's
        features equals its `score_batch` logits; a tuner that trains only the scorer and the scalars
        computes these once instead of the whole forward every step. Raises like `score_batch`."""
        if not hiddens and not layouts and not option_lexicals:
            return []
        index = self._batch_index(hiddens, layouts, option_lexicals)
        # no_grad, not inference mode: inference tensors could not enter a later autograd graph.
        with torch.no_grad():
            hidden_rows, lexical_rows = self._packed_inputs(hiddens, option_lexicals)
            packed = self._option_features(hidden_rows, lexical_rows, index)
        return packed.split(index.option_counts)

    def memory_rows(self, hidden: Tensor) -> Tensor:
        """The memory [T, width] fp32 every routing and decoder layer attends to: LN(hidden) projected.
        Attribution (`clef_runtime.model.attribution`) differentiates with respect to it: the head reads a
        state row only through its memory row, and a row's raw hidden vector would give gradient x input
        0 (the LayerNorm makes the head blind to a row's scale)."""
        return self._memory_rows(hidden.to(self.device))

    def logits_from_memory(
        self, hidden: Tensor, layout: HeadLayout, option_lexical: Tensor, memory: Tensor
    ) -> Tensor:
        """One record's [O] logits with ``memory`` [T, width] (what `memory_rows` gives, or a tensor derived
        from it, e.g. scaled or with grad) in place of the memory computed from ``hidden``; or, for ``memory``
        [n, T, width], the [n, O] logits of n variants of the record scored in one batch. With autograd when
        grad is enabled. Raises like `score`."""
        variants = 1 if memory.dim() == 2 else memory.shape[0]
        index = self._batch_index([hidden] * variants, [layout] * variants, [option_lexical] * variants)
        hidden_rows, lexical_rows = self._packed_inputs([hidden] * variants, [option_lexical] * variants)
        packed_memory = memory.reshape(-1, memory.shape[-1])
        features = self._option_features(hidden_rows, lexical_rows, index, memory=packed_memory)
        logits = self._score_options(features)
        return logits if memory.dim() == 2 else logits.view(variants, -1)

    @contextlib.contextmanager
    def recording_attention(self) -> Iterator[list[tuple[str, Tensor]]]:
        """Within the block, every forward appends each memory attention's probabilities [B, heads, L, T]
        to the yielded list, tagged ``"evidence"`` (a routing layer: options attend) or ``"decoder"`` (a
        decoder layer: fields attend), in layer order. Not thread-safe: the caller holds the model."""
        log: list[tuple[str, Tensor]] = []
        self._attention_log = log
        try:
            yield log
        finally:
            self._attention_log = None

    def option_logits(self, features: OptionFeatures) -> Tensor:
        """The [O] logits of (possibly concatenated) `OptionFeatures`: the last step of the forward, with
        autograd when grad is enabled (the features themselves are constants)."""
        return self._score_options(features)

    def save_files(self, directory: str | Path) -> Path:
        """Writes this head in the release layout: ``joint_head.safetensors`` (every tensor of the
        state_dict, fp32, contiguous, the release's names) and ``joint_head_config.json`` (the constructor
        keys, readable by `read_head_config`), so that `from_files` loads it strictly.

        Each file is written to a temporary name and renamed, so a reader never sees half a head. Returns
        ``directory``. Raises OSError when it cannot be written.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            name: value.detach().to(device="cpu", dtype=torch.float32).contiguous().clone()
            for name, value in self.state_dict().items()
        }
        weights = directory / HEAD_WEIGHTS_FILE
        config = directory / HEAD_CONFIG_FILE
        staged_weights = weights.with_name(weights.name + ".tmp")
        staged_config = config.with_name(config.name + ".tmp")
        save_file(tensors, str(staged_weights))
        staged_config.write_text(json.dumps(self.config, indent=2) + "\n", encoding="utf-8")
        staged_weights.replace(weights)
        staged_config.replace(config)
        return directory

    def _batch_index(
        self, hiddens: Sequence[Tensor], layouts: Sequence[HeadLayout], option_lexicals: Sequence[Tensor]
    ) -> _BatchIndex:
        """Checks one batch's inputs and flattens its layouts. Raises ValueError."""
        if not (len(hiddens) == len(layouts) == len(option_lexicals)):
            raise ValueError(
                f"score_batch: {len(hiddens)} hiddens, {len(layouts)} layouts, "
                f"{len(option_lexicals)} option_lexicals"
            )
        for record, (hidden, layout, lexical) in enumerate(
            zip(hiddens, layouts, option_lexicals, strict=True)
        ):
            if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size or not hidden.is_floating_point():
                raise ValueError(
                    f"record {record}: hidden must be a float [T, {self.hidden_size}] tensor, "
                    f"got {hidden.dtype} {list(hidden.shape)}"
                )
            if hidden.shape[0] == 0:
                raise ValueError(f"record {record}: hidden has no rows")
            if tuple(lexical.shape) != (layout.num_options, self.hidden_size):
                raise ValueError(
                    f"record {record}: option_lexical must be [{layout.num_options}, {self.hidden_size}], "
                    f"got {list(lexical.shape)}"
                )
        return _BatchIndex.build(layouts, [hidden.shape[0] for hidden in hiddens], self.device)

    def _packed_inputs(
        self, hiddens: Sequence[Tensor], option_lexicals: Sequence[Tensor]
    ) -> tuple[Tensor, Tensor]:
        """The records' hidden rows end to end on the head's device (their dtype kept: they are cast to
        fp32 in blocks or after gathering) and their option lexical rows in fp32."""
        device = self.device
        if len(hiddens) == 1:
            hidden_rows = hiddens[0].to(device)
        else:
            hidden_rows = torch.cat([hidden.to(device) for hidden in hiddens])
        lexical_rows = torch.cat(
            [lexical.to(device=device, dtype=torch.float32) for lexical in option_lexicals]
        )
        return hidden_rows, lexical_rows

    # --- forward pieces -------------------------------------------------------------------------------

    def _memory_rows(self, hidden_rows: Tensor) -> Tensor:
        """M = LN_hidden(hidden) @ memory_projectionᵀ, [N, W] fp32, computed in row blocks."""
        num_rows = hidden_rows.shape[0]
        block = max(1, self.memory_chunk_rows)
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            # Autograd cannot differentiate writes into `out=`; the blocks are kept for backward anyway.
            return torch.cat(
                [
                    F.linear(
                        _layer_norm(hidden_rows[start : start + block].to(torch.float32), self.hidden_norm),
                        self.memory_projection.weight,
                    )
                    for start in range(0, num_rows, block)
                ]
            )
        memory = torch.empty(num_rows, self.width, dtype=torch.float32, device=hidden_rows.device)
        for start in range(0, num_rows, block):
            normed = _layer_norm(hidden_rows[start : start + block].to(torch.float32), self.hidden_norm)
            torch.matmul(normed, self.memory_projection.weight.t(), out=memory[start : start + block])
        return memory

    def _span_means(self, hidden_rows: Tensor, index: _BatchIndex) -> Tensor:
        """Mean of LN_hidden rows over every span, [S, hidden_size] fp32 (questions first, then options)."""
        normed = _layer_norm(hidden_rows[index.span_rows].to(torch.float32), self.hidden_norm)
        sums = normed.new_zeros(index.span_lengths.shape[0], self.hidden_size)
        sums.index_add_(0, index.span_segments, normed)
        return sums / index.span_lengths[:, None]

    def _split_heads(self, values: Tensor) -> Tensor:
        """[B, L, W] -> [B, heads, L, head_dim]."""
        batch, length, _ = values.shape
        return values.view(batch, length, self.heads, self.head_dim).transpose(1, 2)

    def _keys_values(
        self, memory_rows: Tensor, attention: nn.MultiheadAttention, index: _BatchIndex
    ) -> tuple[Tensor, Tensor]:
        """Projects packed memory rows to keys and values and pads them: two [B, heads, T, head_dim]."""
        width = self.width
        packed = F.linear(memory_rows, attention.in_proj_weight[width:], attention.in_proj_bias[width:])
        padded = _pad(packed, index.token_slots, index.batch_size, index.max_tokens)
        batch, length, _ = padded.shape
        keys_values = padded.view(batch, length, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return keys_values[0], keys_values[1]

    def _attend(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        attention: nn.MultiheadAttention,
        key_mask: Tensor | None,
        tag: str | None = None,
    ) -> Tensor:
        """Multi-head attention output (after out_proj) for already projected, head-split q/k/v; ``tag``
        names a memory attention for `recording_attention`."""
        log = self._attention_log
        if log is not None and tag is not None:
            scores = torch.matmul(queries, keys.transpose(-1, -2)) / math.sqrt(self.head_dim)
            if key_mask is not None:
                scores = scores.masked_fill(~key_mask, -math.inf)
            log.append((tag, torch.softmax(scores, dim=-1).detach()))
        mixed = F.scaled_dot_product_attention(queries, keys, values, attn_mask=key_mask)
        batch, _, length, _ = mixed.shape
        merged = mixed.transpose(1, 2).reshape(batch, length, self.width)
        return F.linear(merged, attention.out_proj.weight, attention.out_proj.bias)

    def _cross_attend(
        self,
        query_input: Tensor,
        keys: Tensor,
        values: Tensor,
        attention: nn.MultiheadAttention,
        key_mask: Tensor | None,
        tag: str,
    ) -> Tensor:
        width = self.width
        queries = F.linear(query_input, attention.in_proj_weight[:width], attention.in_proj_bias[:width])
        return self._attend(self._split_heads(queries), keys, values, attention, key_mask, tag)

    def _self_attend(
        self, inputs: Tensor, attention: nn.MultiheadAttention, key_mask: Tensor | None
    ) -> Tensor:
        batch, length, _ = inputs.shape
        projected = F.linear(inputs, attention.in_proj_weight, attention.in_proj_bias)
        qkv = projected.view(batch, length, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return self._attend(qkv[0], qkv[1], qkv[2], attention, key_mask)

    @staticmethod
    def _feedforward(inputs: Tensor, first: nn.Linear, second: nn.Linear) -> Tensor:
        return F.linear(F.gelu(F.linear(inputs, first.weight, first.bias)), second.weight, second.bias)

    def _logits(self, hidden_rows: Tensor, lexical_rows: Tensor, index: _BatchIndex) -> Tensor:
        """The reference forward (docs/model.md section 6) over a packed batch; returns packed [O] logits."""
        return self._score_options(self._option_features(hidden_rows, lexical_rows, index))

    def _option_features(
        self, hidden_rows: Tensor, lexical_rows: Tensor, index: _BatchIndex, memory: Tensor | None = None
    ) -> OptionFeatures:
        """The forward up to the scoring step: routing, joint decoding and the parameter-free pieces of the
        scores, packed per option (``memory``: given instead of computed from ``hidden_rows``)."""
        batch, width = index.batch_size, self.width
        if memory is None:
            memory = self._memory_rows(hidden_rows)  # [N, W], also used un-normalised by the decoder
        span_means = self._span_means(hidden_rows, index)
        num_questions = index.question_types.shape[0]
        question_means, option_context = span_means[:num_questions], span_means[num_questions:]
        global_vectors = _layer_norm(hidden_rows[index.last_token_rows].to(torch.float32), self.hidden_norm)

        # Options: contextual + lexical + owning-question vectors, then evidence routing over the memory.
        routed_packed = (
            F.linear(option_context, self.option_context_projection.weight)
            + F.linear(lexical_rows, self.option_lexical_projection.weight)
            + F.linear(question_means, self.option_question_projection.weight)[index.option_owners]
        )
        routed = _pad(routed_packed, index.option_slots, batch, index.max_options)
        # ModuleList and Sequential are untyped containers: the casts name what __init__ put in them.
        for layer in cast("Iterable[_EvidenceLayer]", self.evidence_layers):
            keys, values = self._keys_values(_layer_norm(memory, layer.memory_norm), layer.attention, index)
            routed = routed + self._cross_attend(
                _layer_norm(routed, layer.query_norm),
                keys,
                values,
                layer.attention,
                index.token_key_mask,
                "evidence",
            )
            routed = routed + self._feedforward(
                _layer_norm(routed, layer.feedforward_norm),
                cast(nn.Linear, layer.feedforward[0]),
                cast(nn.Linear, layer.feedforward[3]),
            )

        # Per-question routing softmax over the question's own options (on R itself, not LN(R)).
        base = _pad(
            F.linear(question_means, self.question_projection.weight),
            index.question_slots,
            batch,
            index.max_questions,
        )
        route_logits = torch.matmul(base, routed.transpose(1, 2)) / math.sqrt(width)
        route_weights = torch.softmax(route_logits.masked_fill(~index.membership, -math.inf), dim=-1)
        # Padded questions own no option: their all -inf rows are NaN; zero them before mixing.
        route_weights = torch.where(index.membership, route_weights, 0.0)
        summaries = torch.matmul(route_weights, routed)
        type_vectors = _pad(
            self.type_embedding.weight[index.question_types], index.question_slots, batch, index.max_questions
        )
        fields = (
            base
            + _layer_norm(summaries, self.option_summary_norm)
            + F.linear(global_vectors, self.global_projection.weight).unsqueeze(1)
            + type_vectors
        )

        # Joint decoding: fields attend to each other and to the un-normalised memory.
        for decoder_layer in cast("Iterable[_FieldDecoderLayer]", self.layers):
            fields = fields + self._self_attend(
                _layer_norm(fields, decoder_layer.norm1), decoder_layer.self_attn, index.question_key_mask
            )
            keys, values = self._keys_values(memory, decoder_layer.multihead_attn, index)
            fields = fields + self._cross_attend(
                _layer_norm(fields, decoder_layer.norm2),
                keys,
                values,
                decoder_layer.multihead_attn,
                index.token_key_mask,
                "decoder",
            )
            fields = fields + self._feedforward(
                _layer_norm(fields, decoder_layer.norm3), decoder_layer.linear1, decoder_layer.linear2
            )
        fields = _layer_norm(fields, self.field_norm)

        # Scoring, packed per option.
        option_fields = _unpad(fields, index.question_slots)[index.option_owners]
        option_rows = _layer_norm(_unpad(routed, index.option_slots), self.option_norm)
        anchors = F.normalize(
            question_means + global_vectors[index.question_records], dim=-1, eps=NORMALIZE_EPS
        )
        lexical_directions = F.normalize(lexical_rows, dim=-1, eps=NORMALIZE_EPS)
        return OptionFeatures(
            option_fields=option_fields,
            option_rows=option_rows,
            lexical_prior=(lexical_directions * anchors[index.option_owners]).sum(-1),
            cosine=F.cosine_similarity(option_fields, option_rows, dim=-1, eps=COSINE_EPS),
        )

    def _score_options(self, features: OptionFeatures) -> Tensor:
        """Scoring: the scaled lexical prior plus the gated joint score (scaled cosine + residual scorer)."""
        option_fields, option_rows = features.option_fields, features.option_rows
        pair_features = torch.cat(
            [option_fields, option_rows, option_fields * option_rows, (option_fields - option_rows).abs()],
            dim=-1,
        )
        first, last = cast(nn.Linear, self.residual_scorer[0]), cast(nn.Linear, self.residual_scorer[3])
        residual = self._feedforward(pair_features, first, last).squeeze(-1)
        joint = _capped_scale(self.joint_logit_scale) * features.cosine + residual
        return (
            _capped_scale(self.prior_logit_scale) * features.lexical_prior
            + torch.sigmoid(self.residual_gate) * joint
        )

    probabilities = staticmethod(probabilities)
