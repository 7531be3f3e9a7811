"""Protobuf wire bytes of ONNX graphs, written and counted a tensor at a time: protobuf's own encoder (`ByteSize`
included) holds a whole graph's bytes two to four times over while it writes them, and reading a tensor's
`raw_data` copies it."""

from __future__ import annotations

import math
from pathlib import Path


def serialized_size(model) -> int:
    """At least the bytes `model` serializes to (a few bytes a tensor over), counted one part at a time. protobuf's
    own ByteSize encodes the whole message to count it: a second copy of every weight and more while its buffer
    grows (a 1B-parameter graph's 3.9 GB of weights took the export stage from 9.5 to 19.3 GB)."""
    graph = model.graph
    parts = [*graph.node, *graph.input, *graph.output, *graph.value_info, *graph.sparse_initializer]
    parts += [*graph.quantization_annotation, *model.opset_import, *model.functions, *model.metadata_props]
    # Each part's key and length prefix: at most 1 + 10 bytes; the graph's and model's scalar fields: under 64 KB.
    return sum(p.ByteSize() + 11 for p in parts) + sum(_field_size(t) for t in graph.initializer) + 65536


def varint(value: int) -> bytes:
    """`value` as a protobuf varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field_key(message, field: str) -> bytes:
    """The wire key of the length-delimited field `field` of the protobuf message type `message`."""
    return varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


def wrapped(message, field: str, value: bytes) -> bytes:
    """`value` as the length-delimited field `field` of `message`."""
    return field_key(message, field) + varint(len(value)) + value


def _tensor_head(tensor):
    """Every field of `tensor` but its raw data, as a TensorProto, where its data is raw bytes it holds; else None.
    Built field by field: anything that lists or copies a tensor's fields (`ListFields`, `CopyFrom`) copies its raw
    data (0.4 s for a 671 MB weight)."""
    from onnx import TensorProto

    if not tensor.HasField("raw_data") or tensor.data_location == TensorProto.EXTERNAL:
        return None
    head = TensorProto()
    for field in TensorProto.DESCRIPTOR.fields:
        if field.name == "raw_data":
            continue
        if _repeated(field):
            getattr(head, field.name).extend(getattr(tensor, field.name))
        elif tensor.HasField(field.name) and field.message_type is not None:
            getattr(head, field.name).CopyFrom(getattr(tensor, field.name))
        elif tensor.HasField(field.name):
            setattr(head, field.name, getattr(tensor, field.name))
    return head


def _repeated(field) -> bool:
    # protobuf 6 deprecates FieldDescriptor.label for is_repeated, which older releases lack.
    if hasattr(field, "is_repeated"):
        return field.is_repeated
    return field.label == field.LABEL_REPEATED


def _tensor_parts(tensor) -> tuple[bytes, bytes]:
    """A tensor's wire bytes as (head, raw data): a tensor holding raw data is encoded around it, which is then
    copied once, and never into a growing encode buffer."""
    from onnx import TensorProto

    head = _tensor_head(tensor)
    if head is None:
        return tensor.SerializeToString(), b""
    raw = tensor.raw_data
    return head.SerializeToString() + field_key(TensorProto, "raw_data") + varint(len(raw)), raw


def _wrappers(size: int) -> bytes:
    """The keys and lengths that put a tensor of `size` wire bytes in a graph field of its own, as an initializer
    (protobuf merges the repeated occurrences of a message field into one graph)."""
    from onnx import GraphProto, ModelProto

    initializer = field_key(GraphProto, "initializer") + varint(size)
    return field_key(ModelProto, "graph") + varint(len(initializer) + size) + initializer


# Bytes an element of each TensorProto data type of whole bytes (FLOAT=1 ... BFLOAT16=16, STRING=8 left out).
_WIDTHS = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 14: 8, 15: 16, 16: 2}


def _field_size(tensor) -> int:
    """The wire bytes of `tensor` as an initializer field of its own. Raw data of a whole-byte type is sized from
    the tensor's dims: reading `raw_data` copies it (24 s of a Gemma 3 build's saves)."""
    from onnx import TensorProto

    head = _tensor_head(tensor)
    if head is None:
        size = tensor.ByteSize()
        return len(_wrappers(size)) + size
    width = _WIDTHS.get(tensor.data_type)
    raw = math.prod(tensor.dims) * width if width else len(tensor.raw_data)
    head = head.SerializeToString() + field_key(TensorProto, "raw_data") + varint(raw)
    return len(_wrappers(len(head) + raw)) + len(head) + raw


def write_streamed(model, initializers: list, path: Path) -> None:
    """Write `model` (its initializers taken out) and then each of `initializers`, in order, in its own graph field;
    each tensor leaves the list once written."""
    initializers.reverse()
    with open(path, "wb") as file:
        file.write(model.SerializeToString())
        while initializers:
            head, raw = _tensor_parts(initializers.pop())
            file.write(_wrappers(len(head) + len(raw)) + head)
            file.write(raw)
