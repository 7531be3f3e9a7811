"""Graph files on disk: one `.onnx` file where the graph fits in one protobuf, else the graph plus one data file.

    model.onnx                      the whole graph, weights included (under SINGLE_FILE_LIMIT bytes)
    model.onnx + model.onnx.data    the graph, and every initializer of INLINE_BELOW bytes or more, beside it

ONNX's protobuf cannot pass 2 GB, which every fp32 decoder from about 0.5B parameters does. A data file is named
after its graph (`<graph name>.data`) and referenced by that bare name: a location read from a graph is hostile
until checked, and one holding a path separator or `..` is refused. Every graph the build writes, copies or moves
goes through this module, so the stages, the cache and the artifact see the same pair of files.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

from pipeline.build.onnx_wire import field_key, serialized_size, varint, wrapped, write_streamed
from pipeline.errors import ExportError

# Bytes of serialized graph past which the weights go to a data file; under protobuf's 2 GB with room for the
# graph's own growth. Tests lower it to force a tiny model into a data file.
SINGLE_FILE_LIMIT = 1_900_000_000
# Initializers smaller than this stay in the graph (shapes, scalars, axes), as ONNX Runtime's optimizer keeps them.
INLINE_BELOW = 1024


def data_name(graph: Path) -> str:
    """The data file name of the graph file `graph`: `<graph name>.data`."""
    return Path(graph).name + ".data"


def _external_tensors(model):
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    return [t for t in _get_all_tensors(model) if uses_external_data(t)]


def _location(tensor, graph: Path) -> str:
    """The checked location of an external tensor: a bare file name beside the graph."""
    location = next((e.value for e in tensor.external_data if e.key == "location"), "")
    if not location or "/" in location or "\\" in location or ".." in location or location.startswith("."):
        raise ExportError(
            f"{graph}: tensor {tensor.name!r} keeps its data at {location!r}, which is not a plain file name beside "
            "the graph; only data files in the graph's own folder are read. Re-export the model."
        )
    return location


def graph_files(path: Path) -> list[Path]:
    """The graph file `path` and the data files it references (each checked to be a bare name beside it)."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    locations = sorted({_location(t, path) for t in _external_tensors(model)})
    return [path, *(path.parent / name for name in locations)]


def load_graph(path: Path, load_data: bool = True):
    """The ModelProto of the graph file `path`, its external data read in from beside it (checked first)."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    for tensor in _external_tensors(model):
        _location(tensor, path)
    if load_data:
        load_external(model, path)
    return model


def load_structure(path: Path, inline_below: int = INLINE_BELOW):
    """The ModelProto of the graph file `path` without the bytes of its large tensors: a data file's tensors stay
    there (checked), and an inline initializer of `inline_below` bytes or more is pointed at its raw data inside the
    graph file itself, as if that were its data file. `read_array` then reads one weight at a time, and
    `load_external` the rest; `onnx.load` would hold a one-file graph's bytes twice, then its whole proto."""
    from onnx import GraphProto, ModelProto

    path = Path(path)
    with open(path, "rb") as file:
        size = file.seek(0, os.SEEK_END)
        model = bytearray()
        for number, start, value, end in _fields(file, 0, size):
            if number == ModelProto.DESCRIPTOR.fields_by_name["graph"].number and value is not None:
                graph = bytearray()
                for inner, field_start, tensor, field_end in _fields(file, value, end):
                    if inner == GraphProto.DESCRIPTOR.fields_by_name["initializer"].number and tensor is not None:
                        pointed = _pointed(file, tensor, field_end, path, inline_below)
                        graph += wrapped(GraphProto, "initializer", pointed)
                    else:
                        graph += _read(file, field_start, field_end)
                model += field_key(ModelProto, "graph") + varint(len(graph)) + graph
            else:
                model += _read(file, start, end)
    loaded = ModelProto.FromString(bytes(model))
    for tensor in _external_tensors(loaded):
        _location(tensor, path)
    return loaded


def _read(file, start: int, end: int) -> bytes:
    file.seek(start)
    return file.read(end - start)


def _read_varint(file) -> int:
    value, shift = 0, 0
    while True:
        byte = file.read(1)
        if not byte:
            raise ExportError(f"{file.name}: the graph file ends inside a field; it is truncated. Re-export the model.")
        value |= (byte[0] & 0x7F) << shift
        shift += 7
        if byte[0] < 0x80:
            return value


def _fields(file, start: int, end: int):
    """(field number, start of the field, start of its value where length-delimited else None, end) of each
    protobuf field between `start` and `end` of `file`."""
    position = start
    while position < end:
        file.seek(position)
        key = _read_varint(file)
        wire = key & 7
        if wire == 0:
            _read_varint(file)
            value, stop = None, file.tell()
        elif wire == 2:
            length = _read_varint(file)
            value = file.tell()
            stop = value + length
        elif wire in (1, 5):
            value, stop = None, file.tell() + (8 if wire == 1 else 4)
        else:
            raise ExportError(f"{file.name}: protobuf wire type {wire} at byte {position} is not ONNX's; re-export.")
        if stop > end:
            raise ExportError(f"{file.name}: a field at byte {position} runs past its message; it is truncated.")
        yield key >> 3, position, value, stop
        position = stop


def _pointed(file, start: int, end: int, path: Path, inline_below: int) -> bytes:
    """The tensor encoded between `start` and `end` of the graph file `path`, its raw data (where it has any) left
    in the file and pointed at there."""
    from onnx import TensorProto

    if end - start < inline_below:
        return _read(file, start, end)
    rest, raw = bytearray(), None
    for number, field_start, value, field_end in _fields(file, start, end):
        if number == TensorProto.DESCRIPTOR.fields_by_name["raw_data"].number and value is not None:
            raw = (value, field_end - value)
        else:
            rest += _read(file, field_start, field_end)
    if raw is None:
        return _read(file, start, end)
    tensor = TensorProto.FromString(bytes(rest))
    for key, value in (("location", path.name), ("offset", raw[0]), ("length", raw[1])):
        tensor.external_data.add(key=key, value=str(value))
    tensor.data_location = TensorProto.EXTERNAL
    return tensor.SerializeToString()


def load_external(model, path: Path) -> None:
    """Read into `model` the data of the tensors it still keeps in data files beside its graph file `path`."""
    from onnx.external_data_helper import load_external_data_for_model

    external = _external_tensors(model)
    for tensor in external:
        _location(tensor, Path(path))
    if external:
        load_external_data_for_model(model, str(Path(path).parent))


def read_array(tensor, path: Path):
    """The numpy array of the initializer `tensor` of the graph file `path`: where its data is in a data file,
    only its own bytes are read (at its offset), so a graph's weights can be visited one at a time."""
    import numpy as np
    from onnx import helper, numpy_helper
    from onnx.external_data_helper import uses_external_data

    if not uses_external_data(tensor):
        return numpy_helper.to_array(tensor)
    path = Path(path)
    file = path.parent / _location(tensor, path)
    entries = {e.key: e.value for e in tensor.external_data}
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    count = int(np.prod(tensor.dims, dtype=np.int64))
    offset, length = int(entries.get("offset", 0)), int(entries.get("length", count * dtype.itemsize))
    if length != count * dtype.itemsize or offset < 0 or offset + length > file.stat().st_size:
        raise ExportError(
            f"{path}: tensor {tensor.name!r} of shape {list(tensor.dims)} claims bytes {offset}..{offset + length} "
            f"of {file.name} ({file.stat().st_size} bytes), which do not hold it. Re-export the model."
        )
    return np.fromfile(file, dtype=dtype, count=count, offset=offset).reshape(tuple(tensor.dims))


def save_graph(model, path: Path, consume: bool = False) -> list[Path]:
    """Write `model` to `path`: one file where it serializes under SINGLE_FILE_LIMIT bytes, else with every
    initializer of INLINE_BELOW bytes or more in `<name>.data` beside it. Returns the files written.

    Writing a data file moves the weights out of `model` (its tensors then point at the file), which frees their
    memory; `model` must hold its data (loaded with `load_graph`, not `load_data=False`). With `consume`, a graph
    under the limit gives its initializers up to the file (it is left without them) and is written one initializer
    at a time: protobuf's own encoder (`ByteSize` included) holds a whole graph's bytes two to four times over while
    it writes them. Whether it fits is counted a part at a time (`serialized_size`) for the same reason."""
    import onnx

    path = Path(path)
    data = path.parent / data_name(path)
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    if _external_tensors(model):
        raise ExportError(f"cannot write {path}: the graph still points at external data it has not loaded")
    fits = serialized_size(model) < SINGLE_FILE_LIMIT
    if fits and consume:
        initializers = list(model.graph.initializer)
        del model.graph.initializer[:]  # the list keeps each tensor
        write_streamed(model, initializers, path)
        return [path]
    if fits:
        onnx.save_model(model, str(path))
        return [path]
    # Over the limit, onnx writes each tensor to the data file in place. (Taking the initializers out and putting
    # them back, as `consume` does, would copy every weight: protobuf keeps what leaves a field until the graph goes.)
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data.name,
        size_threshold=INLINE_BELOW,
        convert_attribute=False,
    )
    return [path, data]


def _place(source: Path, dest: Path, move: bool) -> list[Path]:
    source, dest = Path(source), Path(dest)
    files = graph_files(source)
    transfer = os.replace if move else shutil.copyfile
    if len(files) == 1:
        transfer(source, dest)
        return [dest]
    data = dest.parent / data_name(dest)
    if len(files) == 2 and files[1].name == data.name:  # the name pair is kept: the graph's bytes need no change
        transfer(files[1], data)
        transfer(source, dest)
        return [dest, data]
    if len(files) == 2:  # one data file under another name: point the graph at the new name, data unchanged
        import onnx

        model = onnx.load(str(source), load_external_data=False)
        for tensor in _external_tensors(model):
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = data.name
        transfer(files[1], data)
        dest.write_bytes(model.SerializeToString())
        if move:
            source.unlink()
        return [dest, data]
    written = save_graph(load_graph(source), dest)  # several data files (another exporter's): one from here on
    if move:
        for file in files:
            file.unlink()
    return written


def copy_graph(source: Path, dest: Path) -> list[Path]:
    """Copy the graph file `source` and its data to `dest` (its data to `<dest name>.data`); the files written."""
    return _place(source, dest, move=False)


def move_graph(source: Path, dest: Path) -> list[Path]:
    """Move the graph file `source` and its data to `dest` (its data to `<dest name>.data`); the files written."""
    return _place(source, dest, move=True)


def save_if_small(path: Path) -> list[Path]:
    """Rewrite the graph file `path` as one file where it now fits (a quantizer's output, written with a data file
    because its source had one); its files either way."""
    files = graph_files(path)
    if len(files) == 1 or sum(f.stat().st_size for f in files) >= SINGLE_FILE_LIMIT:
        return files
    model = load_graph(path)
    for file in files[1:]:
        file.unlink()
    return save_graph(model, path)


def tensor_readers(graph) -> Counter:
    """How many times each tensor name is read: by a node (of this graph or a subgraph) or as a graph output."""
    from onnx import AttributeProto

    counts = Counter(o.name for o in graph.output)
    stack = [graph]
    while stack:
        for node in stack.pop().node:
            counts.update(i for i in node.input if i)
            for attribute in node.attribute:
                if attribute.type == AttributeProto.GRAPH:
                    stack.append(attribute.g)
                elif attribute.type == AttributeProto.GRAPHS:
                    stack.extend(attribute.graphs)
    return counts


def drop_initializer(graph, name: str) -> None:
    """Remove the initializer `name` (and a graph input of that name, as older graphs list them) from `graph`."""
    for field in (graph.initializer, graph.input):
        index = next((i for i, t in enumerate(field) if t.name == name), None)
        if index is not None:
            del field[index]


def with_opset(model, domain: str, version: int = 1) -> None:
    """Make `model` import `domain` at `version` (added, or its version set), e.g. com.microsoft for contrib ops."""
    from onnx import helper

    found = next((o for o in model.opset_import if o.domain == domain), None)
    if found is None:
        model.opset_import.append(helper.make_opsetid(domain, version))
    else:
        found.version = version


def traced_to_onnx(module, args: tuple, path: Path, names: tuple[list, list], axes: dict, opset: int) -> None:
    """`module` traced on `args` into `path` by torch.onnx's TorchScript exporter, with `names` (inputs,
    outputs), dynamic `axes` and constants folded: ONNX Runtime's transformer fusions recognise its attention
    pattern, and find none in the dynamo exporter's graph. torch's tracer warnings are silenced."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            args,
            str(path),
            dynamo=False,
            opset_version=opset,
            input_names=names[0],
            output_names=names[1],
            dynamic_axes=axes,
            do_constant_folding=True,
        )
