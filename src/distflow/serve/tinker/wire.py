"""The Tinker SDK's wire shapes (tinker 0.38), decoded into plain values and encoded back.

    POST /api/v1/forward_backward   body: protobuf `ForwardBackwardRequest` (the SDK's tinker_public_pb2)
                                    ──decode──▶ FwdBwdRequest(model_id, loss_fn, config, data=[Datum])
    retrieve_future of a fwd/bwd    ◀──encode── protobuf `ForwardBackwardOutput`: one `ArrayRecord`,
                                    each field a `BatchedTensor` (every datum's values, byte offsets)
    retrieve_future of a sample     ◀──encode── protobuf `SampleResponse` (int32 tokens, float32 log-probs)
    everything else                 JSON, as the SDK's pydantic models dump and parse it

The SDK asks for protobuf (`Accept: application/x-protobuf`) exactly for those two results
(`tinker.proto.response_conv.PROTO_SUPPORTED_TYPES`) and refuses JSON for them, so they are the only
binary responses. A malformed request is a `WireError` (HTTP 400 with its message), never a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class WireError(ValueError):
    """A request the protocol cannot carry (bad bytes, a wrong type, a missing field): HTTP 400."""


@dataclass
class Datum:
    """One sequence: its input tokens and its loss inputs, each a float32 or int64 tensor, all of length T."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor]


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    data: list[Datum]
    forward_only: bool


@dataclass
class FwdBwdResult:
    """Per datum, each output's values (float32, length T); and the batch's metrics (`loss:sum`)."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]
    output_type: str = "ArrayRecord"


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None = None  # NaN at position 0 (nothing predicts it)
    sequence_ids: list[str] = field(default_factory=list)


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _numpy_dtype(pb, dtype: int) -> np.dtype:
    kinds = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if dtype not in kinds:
        raise WireError(f"unsupported tensor dtype {dtype} (the SDK sends float32 or int64)")
    return np.dtype(kinds[dtype])


def tensor_from_proto(msg) -> torch.Tensor:
    """A proto `Tensor` (dense, or sparse CSR with zeros elsewhere) as a torch tensor of its shape."""
    pb = _pb()
    dtype = _numpy_dtype(pb, msg.dtype)
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        if len(shape) != 2:
            raise WireError(f"a sparse tensor must be 2-D (got shape {shape})")
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(crow) != shape[0] + 1 or len(col) != len(values) or (len(col) and col.max() >= shape[1]):
            raise WireError("a sparse tensor's indices do not match its shape")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, col] = values
        return torch.from_numpy(dense)
    values = np.frombuffer(msg.dense, dtype=dtype).copy()
    if shape and int(np.prod(shape)) != values.size:
        raise WireError(f"a tensor of shape {shape} carries {values.size} values")
    return torch.from_numpy(values.reshape(shape) if shape else values)


def _chunk_tokens(chunk) -> list[int]:
    if chunk.WhichOneof("chunk") != "encoded_text":
        raise WireError(f"only token chunks are served (got a {chunk.WhichOneof('chunk')} chunk)")
    return np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).astype(np.int64).tolist()


def _loss_config(msg) -> dict[str, float | str]:
    config: dict[str, float | str] = {key: float(value) for key, value in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():  # the SDK's newer map wins where both are set
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    return config


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    """The SDK's protobuf `ForwardBackwardRequest` (resources/training.py) as plain values."""
    from google.protobuf.message import DecodeError

    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as err:
        raise WireError(f"the forward_backward body is not a ForwardBackwardRequest protobuf: {err}") from None
    data = []
    for datum in msg.data:
        tokens = [t for chunk in datum.model_input for t in _chunk_tokens(chunk)]
        inputs = {name: tensor_from_proto(tensor) for name, tensor in datum.loss_fn_inputs.items()}
        data.append(Datum(tokens=tokens, inputs=inputs))
    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        config=_loss_config(msg),
        data=data,
        forward_only=msg.forward_only,
    )


def encode_forward_backward(result: FwdBwdResult) -> bytes:
    """A `FwdBwdResult` as the protobuf `ForwardBackwardOutput` the SDK's response_conv.py reads."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type=result.output_type)
    out.metrics.update(result.metrics)
    record = out.loss_fn_outputs.add(num_datums=len(result.outputs))
    names = list(result.outputs[0]) if result.outputs else []
    for name in names:
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32).reshape(-1) for o in result.outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32
            )
        )
    return out.SerializeToString()


def encode_sample(result: SampleResult) -> bytes:
    """A `SampleResult` as the protobuf `SampleResponse` the SDK's response_conv.py reads."""
    pb = _pb()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    out = pb.SampleResponse()
    for seq in result.sequences:
        out.sequences.add(
            stop_reason=reasons[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
        )
    if result.prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(result.prompt_logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()


def json_tokens(model_input: object) -> list[int]:
    """The tokens of a JSON `ModelInput` ({"chunks": [{"type": "encoded_text", "tokens": [...]}, ...]})."""
    if not isinstance(model_input, dict) or not isinstance(model_input.get("chunks"), list):
        raise WireError("a model input must be an object with a list of chunks")
    tokens: list[int] = []
    for chunk in model_input["chunks"]:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise WireError(f"only token chunks are served (got a {kind} chunk)")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise WireError("a chunk's tokens must be a list of integers")
        tokens.extend(ids)
    return tokens
