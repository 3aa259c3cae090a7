"""The baseline: the reference way of running Clef, implemented here (see the package docstring)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.engine_bench.measure import _synchronize, _text_model, backbone_flops, int8_flops
from benchmarks.engine_bench.workload import Workload

# ----------------------------------------------------------------------------------------- baseline


@contextlib.contextmanager
def _stock_forward(model: nn.Module) -> Iterator[None]:
    """Run ``model`` with transformers' own Gated DeltaNet forward, restoring our kernels afterwards."""
    try:
        from clef_runtime.model import kernels
    except ImportError:  # no kernels module: the model already runs the stock forward
        yield
        return
    installed = kernels.kernels_installed(model)
    if installed:
        kernels.uninstall_cpu_kernels(model)
    try:
        yield
    finally:
        if installed:
            kernels.install_cpu_kernels(model)


class ReferenceBaseline:
    """The reference way of answering a request, on the weights of a loaded `Clef` (nothing is copied).

    Encoding: every piece through the Hugging Face tokenizer, no piece cache. Backbone: one full forward of
    transformers' stock ``Qwen3_5TextModel`` from ``input_ids`` (positions inferred by transformers). Head:
    the forward of docs/model.md section 6 written with per-question and per-option Python loops, torch's
    ``nn.TransformerDecoderLayer`` for the decoder layers and the head's ``nn.MultiheadAttention`` modules
    for evidence routing. Answers: per-question fp32 softmax and the shared response builder.
    """

    def __init__(self, clef: Any) -> None:
        from clef_runtime.encoding.encoder import Encoder

        self.clef = clef
        self.model = clef.backbone.model
        self.device = clef.backbone.device
        self.head = clef.head
        self.lexical_weight: Tensor = clef.lexical.weight
        self.encoder = Encoder(clef.tokenizer, max_length=clef.card.options.max_length, cache_chars=0)
        config = self.head.config
        self.decoder_layers: list[nn.TransformerDecoderLayer] = []
        for layer in self.head.layers:
            with torch.device("meta"):
                decoder = nn.TransformerDecoderLayer(
                    d_model=config["width"],
                    nhead=config["heads"],
                    dim_feedforward=config["feedforward"],
                    dropout=0.0,
                    activation="gelu",
                    layer_norm_eps=1e-5,
                    batch_first=True,
                    norm_first=True,
                )
            # assign=True shares the head's own tensors: same weights, no copy.
            decoder.load_state_dict(layer.state_dict(), strict=True, assign=True)
            self.decoder_layers.append(decoder.eval())

    def encode(self, workload: Workload) -> tuple[Any, Any]:
        """Parse and encode a request without any cache; returns (parsed request, EncodedRecord)."""
        from clef_runtime.protocol.systemone import parse_request

        parsed = parse_request(workload.body)
        kwargs = {} if workload.max_length is None else {"max_length": workload.max_length}
        return parsed, self.encoder.encode(parsed, **kwargs)

    def hidden_states(self, input_ids: Sequence[int]) -> Tensor:
        """One full stock forward; returns the [T, hidden] final-norm rows as fp32."""
        ids = torch.tensor([list(input_ids)], dtype=torch.long, device=self.device)
        with torch.inference_mode(), _stock_forward(self.model):
            output = _text_model(self.model)(input_ids=ids, use_cache=False)
        return output.last_hidden_state[0].float()

    def head_logits(self, hidden: Tensor, input_ids: Sequence[int], record: Any) -> list[Tensor]:
        """The head's option logits, one [options] tensor per question, computed question by question and
        option by option. ``hidden`` is the record's [T, hidden] backbone rows."""
        head = self.head
        width = head.width
        with torch.inference_mode():
            normed = head.hidden_norm(hidden.to(device=head.device, dtype=torch.float32))
            memory = head.memory_projection(normed)[None]
            global_row = normed[-1]
            question_vectors: list[Tensor] = []
            routed_rows: list[Tensor] = []
            lexical_rows: list[Tensor] = []
            for question in record.questions:
                start, end = question.question_span
                question_vector = normed[start:end].mean(0)
                question_vectors.append(question_vector)
                for start, end in question.option_spans:
                    context = normed[start:end].mean(0)
                    token_ids = torch.tensor(input_ids[start:end], dtype=torch.long)
                    lexical = self.lexical_weight[token_ids.to(self.lexical_weight.device)]
                    lexical = lexical.to(device=head.device, dtype=torch.float32).mean(0)
                    lexical_rows.append(lexical)
                    routed_rows.append(
                        head.option_context_projection(context)
                        + head.option_lexical_projection(lexical)
                        + head.option_question_projection(question_vector)
                    )
            routed = torch.stack(routed_rows)[None]
            for layer in head.evidence_layers:
                normed_memory = layer.memory_norm(memory)
                attended = layer.attention(
                    layer.query_norm(routed), normed_memory, normed_memory, need_weights=False
                )[0]
                routed = routed + attended
                routed = routed + layer.feedforward(layer.feedforward_norm(routed))
            routed = routed[0]
            global_vector = head.global_projection(global_row)
            fields = []
            offset = 0
            for index, question in enumerate(record.questions):
                count = len(question.option_spans)
                base = head.question_projection(question_vectors[index])
                options = routed[offset : offset + count]
                weights = torch.softmax(options @ base / math.sqrt(width), dim=0)
                summary = weights @ options
                type_vector = head.type_embedding.weight[question.type_id]
                fields.append(base + head.option_summary_norm(summary) + global_vector + type_vector)
                offset += count
            field_rows = torch.stack(fields)[None]
            for decoder in self.decoder_layers:
                field_rows = decoder(field_rows, memory)
            field_rows = head.field_norm(field_rows)[0]
            cap = math.log(100.0)
            prior_scale = head.prior_logit_scale.clamp(max=cap).exp()
            joint_scale = head.joint_logit_scale.clamp(max=cap).exp()
            gate = torch.sigmoid(head.residual_gate)
            logits: list[Tensor] = []
            offset = 0
            for index, question in enumerate(record.questions):
                field_row = field_rows[index]
                anchor = F.normalize(question_vectors[index] + global_row, dim=-1, eps=1e-12)
                values = []
                for option in range(len(question.option_spans)):
                    option_row = head.option_norm(routed[offset + option])
                    lexical_direction = F.normalize(lexical_rows[offset + option], dim=-1, eps=1e-12)
                    prior = prior_scale * torch.dot(lexical_direction, anchor)
                    cosine = F.cosine_similarity(field_row, option_row, dim=0, eps=1e-8)
                    pair = torch.cat(
                        [field_row, option_row, field_row * option_row, (field_row - option_row).abs()]
                    )
                    residual = head.residual_scorer(pair)[0]
                    values.append(prior + gate * (joint_scale * cosine + residual))
                logits.append(torch.stack(values))
                offset += len(question.option_spans)
        return logits

    def decide(self, workload: Workload) -> tuple[dict[str, Any], dict[str, float]]:
        """Answer one request the reference way; returns (System One response, timings in seconds)."""
        from clef_runtime.engine.answers import build_response

        started = time.perf_counter()
        cpu_started = time.process_time()
        parsed, record = self.encode(workload)
        encoded = time.perf_counter()
        hidden = self.hidden_states(record.input_ids)
        _synchronize(self.device)
        backbone_done = time.perf_counter()
        logits = self.head_logits(hidden, record.input_ids, record)
        probabilities = [[float(p) for p in question.float().softmax(-1).tolist()] for question in logits]
        head_done = time.perf_counter()
        response = build_response(parsed, record, probabilities, self.clef.name)
        finished = time.perf_counter()
        return response, {
            "total_s": finished - started,
            "cpu_s": time.process_time() - cpu_started,
            "encode_s": encoded - started,
            "backbone_s": backbone_done - encoded,
            "head_s": head_done - backbone_done,
            "answer_s": finished - head_done,
            "tokens": float(record.input_tokens),
            "backbone_tokens": float(record.input_tokens),
            "flops": backbone_flops(self.model, record.input_tokens),
            "int8_flops": int8_flops(self.model, record.input_tokens),
        }
