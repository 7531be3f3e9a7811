"""Images in: the `pixel_values` that transformers' slow image processors give (ViT, DeiT, BEiT, ConvNeXt, BiT as
DINOv2 uses it, CLIP, SigLIP; Swin checkpoints name ViT's), from the checkpoint's preprocessor_config.json; and the
labels and top k of an image classifier's logits.

    image --RGB--> resize (Pillow, uint8) --> center crop --> * rescale_factor --> (x - mean) / std --> [3, H, W]

Imports numpy, and Pillow lazily where it is needed: to decode files, and to resize, since transformers resizes
with Pillow's filters on uint8 pixels and no other resampler gives the same pixels. Usage:

    spec = ImageSpec.from_config(json.loads(Path("preprocessor_config.json").read_text()))
    batch = pixel_values(["cat.jpg", rgb_array, pil_image], spec)  # [3, 3, 224, 224] float32
    top_k(logits, 5, labels_from_config(json.loads(Path("config.json").read_text())))
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import sys
from collections.abc import Mapping

import numpy as np

from pipeline.errors import ArtifactError, InputError, PipelineError
from pipeline.runtime.sampling import is_int, is_number
from pipeline.runtime.schema import IMAGE_PROCESSOR

# A decompression bomb is a small file whose header claims a huge image: its size is checked before decoding.
MAX_PIXELS = 50_000_000
# Formats Pillow may decode: the common photo formats, not every plugin it ships (fewer decoders, less to attack).
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}  # Pillow's codes
MAX_SIDE = 8192  # the largest size or crop side a config may ask for
_STANDARD = (0.5, 0.5, 0.5)  # transformers' IMAGENET_STANDARD_MEAN and _STD
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_EDGE, _HW = ("shortest_edge",), ("height", "width")  # the keys of a size's two forms
_FORMS = {_EDGE: '{"shortest_edge": n}', _HW: '{"height": h, "width": w}'}
_IMAGE_HINT = "pass a uint8 array (HxWx3 RGB, HxW grey or HxWx4 RGBA), a Pillow image, a file path or a file's bytes"


@dataclasses.dataclass(frozen=True)
class _Processor:
    """What one transformers image processor class reads from its config, and its defaults for what it leaves out."""

    sizes: tuple  # the size forms its resize takes: _EDGE, _HW
    int_size: tuple  # the form a bare int `size` stands for
    size: dict
    resample: int
    crop: bool  # it has a center-crop step (do_center_crop, crop_size)
    convert_rgb: bool
    mean: tuple
    std: tuple
    crop_pct: bool = False  # ConvNeXt's crop_pct rule


_SQUARE = dict(sizes=(_HW,), int_size=_HW)
_SHORT = dict(sizes=(_EDGE, _HW), int_size=_EDGE, size={"shortest_edge": 224})
PROCESSORS = {
    "ViTImageProcessor": _Processor(**_SQUARE, size={"height": 224, "width": 224}, resample=2, crop=False,
                                    convert_rgb=False, mean=_STANDARD, std=_STANDARD),
    "DeiTImageProcessor": _Processor(**_SQUARE, size={"height": 256, "width": 256}, resample=3, crop=True,
                                     convert_rgb=False, mean=_STANDARD, std=_STANDARD),
    "BeitImageProcessor": _Processor(**_SQUARE, size={"height": 256, "width": 256}, resample=3, crop=True,
                                     convert_rgb=False, mean=_STANDARD, std=_STANDARD),
    "ConvNextImageProcessor": _Processor((_EDGE,), _EDGE, {"shortest_edge": 384}, resample=2,
                                         crop=False, convert_rgb=False, mean=_STANDARD, std=_STANDARD, crop_pct=True),
    "BitImageProcessor": _Processor(**_SHORT, resample=3, crop=True, convert_rgb=True, mean=_CLIP_MEAN, std=_CLIP_STD),
    "CLIPImageProcessor": _Processor(**_SHORT, resample=3, crop=True, convert_rgb=True, mean=_CLIP_MEAN, std=_CLIP_STD),
    # SigLIP reads a bare int size as a shortest edge and then fails on it: it takes height and width only.
    "SiglipImageProcessor": _Processor((_HW,), _EDGE, {"height": 224, "width": 224}, resample=3,
                                       crop=False, convert_rgb=False, mean=_STANDARD, std=_STANDARD),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Size:
    """A resize or crop target: `shortest_edge` (the shorter side to it, aspect kept, the longer side's length
    truncated as transformers does) or `height` and `width` (exactly)."""

    shortest_edge: int | None = None
    height: int | None = None
    width: int | None = None

    def to_json(self) -> dict:
        """The form preprocessor_config.json writes: {"shortest_edge": n} or {"height": h, "width": w}."""
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """How a checkpoint's images become pixel_values: what its processor class reads from preprocessor_config.json,
    with that class's defaults for what the file leaves out. `crop_size` is None for classes without a crop step
    (ViT, SigLIP, ConvNeXt); `crop_pct` is ConvNeXt's (a shortest edge under 384 is resized to size / crop_pct,
    then cropped to size x size), else None. `do_convert_rgb` is kept as configured, but every image is made RGB:
    the models take three channels, and transformers fails on any other count where it is off."""

    image_processor_type: str
    do_resize: bool
    size: Size
    resample: int
    do_center_crop: bool
    crop_size: Size | None
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_convert_rgb: bool
    crop_pct: float | None

    @classmethod
    def from_config(cls, config: Mapping, source: str = IMAGE_PROCESSOR) -> ImageSpec:
        """The spec of a checkpoint's preprocessor_config.json (as a dict), read as its transformers class reads it:
        legacy FeatureExtractor names and bare-int sizes are understood, keys the class does not read are ignored.
        An InputError naming `source`, the key and the fix for a value the class would not take."""
        return _parse(config, InputError, source, strict=False)

    @classmethod
    def from_json(cls, data: Mapping) -> ImageSpec:
        """The spec `to_json()` wrote: every field, no other key; an ArtifactError naming the key where not."""
        return _parse(data, ArtifactError, "the artifact's image spec", strict=True)

    def to_json(self) -> dict:
        """Every field, JSON-ready; also a preprocessor_config.json that transformers' class reads to this spec."""
        out = dataclasses.asdict(self)
        out.update(size=self.size.to_json(), crop_size=self.crop_size.to_json() if self.crop_size else None)
        return out | {"image_mean": list(self.image_mean), "image_std": list(self.image_std)}


def _parse(config, error: type[PipelineError], where: str, strict: bool) -> ImageSpec:
    if not isinstance(config, Mapping):
        raise error(f"{where} must be a JSON object, got {type(config).__name__}")
    name = config.get("image_processor_type") or config.get("feature_extractor_type")
    # Legacy checkpoints name the FeatureExtractor; the Fast classes are stood in for by the slow ones they mirror.
    canonical = name.removesuffix("Fast").replace("FeatureExtractor", "ImageProcessor") if isinstance(name, str) else 0
    if canonical not in PROCESSORS:
        raise error(
            f"{where}: image_processor_type {name!r} is not supported; supported: {', '.join(PROCESSORS)} "
            "(or their FeatureExtractor names)"
        )
    keys, fields = set(config), {field.name for field in dataclasses.fields(ImageSpec)}
    if strict and keys != fields:
        raise error(f"{where} has unknown keys {sorted(keys - fields)}, lacks {sorted(fields - keys)}; rebuild it")
    row = PROCESSORS[canonical]

    def flag(key: str, default: bool) -> bool:
        value = config.get(key, default)
        if not isinstance(value, bool):
            raise error(f"{where}: {key}={value!r} must be true or false")
        return value

    resample = config.get("resample", row.resample)
    if not is_int(resample) or resample not in RESAMPLE:
        raise error(f"{where}: resample={resample!r} must be a Pillow filter code: {RESAMPLE}")
    factor = config.get("rescale_factor", 1 / 255)
    if not (is_number(factor) and factor > 0):
        raise error(f"{where}: rescale_factor={factor!r} must be a number > 0 (1/255 maps 0-255 to 0-1)")
    size = _size(config.get("size"), row.size, row.sizes, row.int_size, "size", error, where)
    if canonical == "CLIPImageProcessor" and config.get("use_square_size") and size.shortest_edge:
        size = Size(height=size.shortest_edge, width=size.shortest_edge)  # CLIP's legacy square flag
    crop_pct = 224 / 256 if config.get("crop_pct") is None else config["crop_pct"]
    if row.crop_pct and not (is_number(crop_pct) and 0 < crop_pct <= 1):
        raise error(f"{where}: crop_pct={crop_pct!r} must be a number in (0, 1] (0.875 resizes 224 from 256)")
    return ImageSpec(
        image_processor_type=canonical,
        do_resize=flag("do_resize", True),
        size=size,
        resample=int(resample),
        do_center_crop=flag("do_center_crop", True) if row.crop else False,
        crop_size=_size(config.get("crop_size"), {"height": 224, "width": 224}, (_HW,), _HW, "crop_size", error,
                        where) if row.crop else None,
        do_rescale=flag("do_rescale", True),
        rescale_factor=float(factor),
        do_normalize=flag("do_normalize", True),
        image_mean=_triple(config.get("image_mean"), row.mean, "image_mean", error, where),
        image_std=_triple(config.get("image_std"), row.std, "image_std", error, where),
        do_convert_rgb=row.convert_rgb if config.get("do_convert_rgb") is None else flag("do_convert_rgb", False),
        crop_pct=float(crop_pct) if row.crop_pct else None,
    )  # fmt: skip


def _size(value, default: dict, forms: tuple, int_form: tuple, key: str, error, where: str) -> Size:
    """A size as transformers' get_size_dict reads it (None: the class default); only the forms its class takes."""
    value = default if value is None else value
    if is_int(value):
        value = {"height": value, "width": value} if int_form == _HW else {"shortest_edge": value}
    elif isinstance(value, list | tuple) and len(value) == 2:
        value = {"height": value[0], "width": value[1]}
    if not any(isinstance(value, Mapping) and set(value) == set(form) for form in forms):
        takes = " or ".join(_FORMS[form] for form in forms)
        raise error(f"{where}: {key}={value!r} is not a size this processor takes; give {takes}")
    for side, n in value.items():
        if not is_int(n) or not 1 <= n <= MAX_SIDE:
            raise error(f"{where}: {key}[{side!r}]={n!r} must be an int from 1 to {MAX_SIDE}")
    return Size(**{side: int(n) for side, n in value.items()})


def _triple(value, default: tuple, key: str, error, where: str) -> tuple[float, float, float]:
    """An RGB mean or std: three finite numbers, or one for all three (None: the class default)."""
    value = default if value is None else value
    value = (value,) * 3 if is_number(value) else value
    if not (isinstance(value, list | tuple) and len(value) == 3 and all(is_number(v) for v in value)):
        raise error(f"{where}: {key}={value!r} must be 3 finite numbers (red, green, blue)")
    if key == "image_std" and min(value) <= 0:
        raise error(f"{where}: image_std={list(value)!r} must be > 0 (pixels are divided by it)")
    return tuple(float(v) for v in value)


def pixel_values(images, spec: ImageSpec, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """The model input of `images` (a list): float32 [batch, 3, H, W], equal to what `spec`'s transformers class
    gives. Each image may be a uint8 numpy array (HxWx3 RGB, HxW or HxWx1 grey, HxWx4 RGBA: alpha is dropped, as
    Pillow's convert("RGB") does), a Pillow image (converted to RGB), or a file path or file bytes (decoded by Pillow,
    turned by its EXIF orientation and made RGB, as transformers' load_image does). An InputError naming the input
    and the fix for anything else, for an image over `max_pixels` (a file's header is read before its pixels), or
    for images that come out at different sizes (a spec that neither resizes nor crops)."""
    if isinstance(images, np.ndarray | str | bytes | bytearray | os.PathLike) or _is_pil(images):
        kind = type(images).__name__
        raise InputError(f"pixel_values takes a list of images, got a single {kind}; wrap it: [image]")
    if not isinstance(images, list | tuple) or not images:
        raise InputError(f"pixel_values takes a non-empty list of images, got {images!r:.60}")
    rows = [_pixels(_rgb(image, i, max_pixels), spec, i, max_pixels) for i, image in enumerate(images)]
    shapes = sorted({row.shape for row in rows})
    if len(shapes) > 1:
        raise InputError(
            f"pixel_values: the images come out at different sizes {shapes} (the spec neither resizes nor crops "
            "them to one); pass images of one size, or one at a time"
        )
    return np.stack(rows)


def _is_pil(value) -> bool:
    pil = sys.modules.get("PIL.Image")  # a Pillow image exists only once Pillow is imported: no import to ask
    return pil is not None and isinstance(value, pil.Image)


def _check_pixels(width: int, height: int, what: str, max_pixels: int) -> None:
    if width < 1 or height < 1:
        raise InputError(f"{what} is empty ({width}x{height} pixels); pass an image with pixels")
    if width * height > max_pixels:
        raise InputError(
            f"{what} is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}; shrink it first, "
            "or pass a larger max_pixels if the image is trusted"
        )


def _rgb(image, i: int, max_pixels: int):
    """Input `i` as RGB: an HxWx3 uint8 array, or a Pillow image of mode RGB."""
    what = f"pixel_values input {i}"
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise InputError(f"{what} is a {image.dtype} array; pass uint8 0-255 ([0, 1] floats: (x * 255).round())")
        image = image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image
        if not (image.ndim == 2 or (image.ndim == 3 and image.shape[-1] in (3, 4))):
            raise InputError(f"{what} has shape {image.shape}; {_IMAGE_HINT}; CxHxW: .transpose(1, 2, 0)")
        _check_pixels(image.shape[1], image.shape[0], what, max_pixels)
        # Grey is repeated and alpha dropped: the pixels Pillow's convert("RGB") gives.
        return np.repeat(image[..., None], 3, axis=2) if image.ndim == 2 else np.ascontiguousarray(image[..., :3])
    if isinstance(image, str | bytes | bytearray | memoryview | os.PathLike):
        return _decode(image, what, max_pixels)
    if _is_pil(image):
        _check_pixels(image.width, image.height, what, max_pixels)
        return image if image.mode == "RGB" else image.convert("RGB")
    raise InputError(f"{what} is a {type(image).__name__}, not an image; {_IMAGE_HINT}")


def _decode(source, what: str, max_pixels: int):
    """A file (path or bytes) as transformers' load_image reads it: EXIF-transposed, mode RGB."""
    from PIL import Image, ImageOps

    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise InputError(f"{what} is a URL ({source:.60}); the runtime fetches nothing: download it, pass the bytes")
    name = os.fspath(source) if isinstance(source, str | os.PathLike) else "its bytes"
    file = io.BytesIO(bytes(source)) if isinstance(source, bytes | bytearray | memoryview) else name
    try:
        with Image.open(file, formats=FORMATS) as image:
            _check_pixels(*image.size, f"{what} ({name})", max_pixels)  # the header's size: nothing decoded yet
            return ImageOps.exif_transpose(image).convert("RGB")
    except InputError:
        raise
    except (FileNotFoundError, IsADirectoryError, PermissionError) as err:
        raise InputError(f"{what}: cannot read {name} ({err.strerror}); pass an image file's path or bytes") from None
    except Image.DecompressionBombError as err:  # Pillow's own bound (2 x Image.MAX_IMAGE_PIXELS), checked first
        raise InputError(f"{what} ({name}) is over Pillow's decompression-bomb limit ({err}); shrink it") from None
    except Exception as err:  # Pillow's decoders raise many types (OSError, SyntaxError, ValueError, struct.error)
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise InputError(
            f"{what} ({name}) is not an image Pillow can decode as {'/'.join(FORMATS)} ({why}); {_IMAGE_HINT}"
        ) from None


def _pixels(image, spec: ImageSpec, i: int, max_pixels: int) -> np.ndarray:
    """One RGB image through its transformers class's steps, in its order and dtypes: [3, H, W] float32."""
    pixels = _resize(image, spec, i, max_pixels) if spec.do_resize else np.asarray(image)
    if spec.do_center_crop:
        pixels = _center_crop(pixels, spec.crop_size.height, spec.crop_size.width)
    if spec.do_rescale:  # float64 then float32, as transformers' rescale
        pixels = (pixels.astype(np.float64) * spec.rescale_factor).astype(np.float32)
    if spec.do_normalize:
        # In float32, as transformers' normalize (which takes uint8 to float32 where nothing rescaled it).
        pixels = (pixels.astype(np.float32, copy=False) - np.float32(spec.image_mean)) / np.float32(spec.image_std)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)  # engines take C-order buffers


def _shortest_edge(height: int, width: int, edge: int) -> tuple[int, int]:
    """(height, width) with the shorter side `edge`: transformers' get_resize_output_image_size, its int() kept."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(edge * long / short)
    return (new_long, edge) if width <= height else (edge, new_long)


def _resize(image, spec: ImageSpec, i: int, max_pixels: int) -> np.ndarray:
    """The resized uint8 pixels. Pillow resizes, as in transformers: its filters are what the models were trained
    on, and a numpy bicubic differs from them by a grey level here and there."""
    from PIL import Image

    image = Image.fromarray(image) if isinstance(image, np.ndarray) else image
    width, height = image.size
    size, crop = spec.size, None
    if spec.crop_pct is not None and size.shortest_edge < 384:
        # ConvNeXt: the shorter side to size / crop_pct, then a size x size center crop, inside its resize step.
        target = _shortest_edge(height, width, int(size.shortest_edge / spec.crop_pct))
        crop = size.shortest_edge
    elif spec.crop_pct is not None:
        target = (size.shortest_edge, size.shortest_edge)
    elif size.shortest_edge is not None:
        target = _shortest_edge(height, width, size.shortest_edge)
    else:
        target = (size.height, size.width)
    if target[0] * target[1] > max(max_pixels, MAX_PIXELS):  # a sliver's shorter side scaled up: a huge longer side
        raise InputError(f"pixel_values input {i} ({width}x{height}) resizes to {target[1]}x{target[0]}; crop it")
    pixels = np.asarray(image.resize((target[1], target[0]), resample=spec.resample))
    return _center_crop(pixels, crop, crop) if crop else pixels


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop on HxWxC: top-left at floor((side - crop) / 2); an image smaller than the crop is
    first zero-padded to it, centered with the padding's odd pixel at the top and left."""
    rows, cols = pixels.shape[:2]
    top, left = (rows - height) // 2, (cols - width) // 2
    if top >= 0 and left >= 0:
        return pixels[top : top + height, left : left + width]
    new_rows, new_cols = max(height, rows), max(width, cols)
    padded = np.zeros((new_rows, new_cols, pixels.shape[2]), dtype=pixels.dtype)
    top_pad, left_pad = math.ceil((new_rows - rows) / 2), math.ceil((new_cols - cols) / 2)
    padded[top_pad : top_pad + rows, left_pad : left_pad + cols] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top) : min(new_rows, top + height), max(0, left) : min(new_cols, left + width)]


def labels_from_config(config: Mapping) -> list[str]:
    """A classifier checkpoint's class names (its config.json's id2label, as a dict) in logit order; an InputError
    where they are missing or are not ids 0 to n - 1 naming strings."""
    id2label = config.get("id2label") if isinstance(config, Mapping) else None
    if not isinstance(id2label, Mapping) or not id2label:
        raise InputError("config.json has no id2label; export a classifier checkpoint, whose config names its classes")
    labels: dict[int, str] = {}
    for key, label in id2label.items():
        try:
            labels[int(key)] = label
        except (TypeError, ValueError):
            raise InputError(f"config.json id2label key {key!r} is not a class id; keys are '0', '1', ...") from None
        if not isinstance(label, str):
            raise InputError(f"config.json id2label[{key!r}]={label!r} must be a string")
    if sorted(labels) != list(range(len(id2label))):
        missing = sorted(set(range(len(id2label))) - set(labels))[:5]
        raise InputError(f"config.json id2label ids must be 0 to {len(id2label) - 1} once each; missing {missing}")
    return [labels[i] for i in range(len(labels))]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One class of one image: its label and its softmax probability."""

    label: str
    score: float


def top_k(logits, k: int, labels: list[str]) -> list[list[Prediction]]:
    """The `k` most probable classes of each row of `logits` [batch, classes], by softmax over the classes, most
    probable first (ties: the lower class id first); a k over the class count gives every class, as transformers'
    image-classification pipeline does."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 2:
        raise InputError(f"top_k takes logits [batch, classes], got shape {logits.shape}; one image: logits[None]")
    if logits.shape[1] != len(labels):
        raise ArtifactError(
            f"the model gives {logits.shape[1]} logits a row but its config names {len(labels)} labels; rebuild the "
            "artifact from a checkpoint whose config.json id2label matches its classifier head"
        )
    if not is_int(k) or k < 1:
        raise InputError(f"top_k k={k!r} must be an int >= 1")
    if not np.isfinite(logits).all():
        raise InputError(f"top_k: logits rows {np.nonzero(~np.isfinite(logits).all(1))[0].tolist()} hold NaN or inf")
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))  # shifted: exp cannot overflow
    probs /= probs.sum(axis=1, keepdims=True)
    order = np.argsort(-probs, axis=1, kind="stable")[:, : min(k, len(labels))]
    return [[Prediction(labels[j], float(probs[r, j])) for j in row] for r, row in enumerate(order.tolist())]
