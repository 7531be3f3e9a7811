"""pipeline.runtime.images: transformers' slow image processors' pixel_values, from numpy and Pillow, checked against
those processors on real photographs (scikit-image's data folder), and the refusals of bad images and configs."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import ArtifactError, InputError
from pipeline.runtime.images import PROCESSORS, ImageSpec, Prediction, labels_from_config, pixel_values, top_k

REPO = Path(__file__).resolve().parents[2]
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# The preprocessor_config.json of each checkpoint as published, legacy keys and bare-int sizes included.
CONFIGS = {
    "google/vit-base-patch16-224": {
        "feature_extractor_type": "ViTFeatureExtractor",
        **{"do_normalize": True, "do_resize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
        **{"resample": 2, "size": 224},
    },
    "facebook/deit-small-patch16-224": {
        "feature_extractor_type": "DeiTFeatureExtractor",
        **{"crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True},
        **{"image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD, "resample": 3, "size": 256},
    },
    "microsoft/beit-base-patch16-224": {
        "feature_extractor_type": "BeitFeatureExtractor",
        **{"crop_size": 224, "do_center_crop": False, "do_normalize": True, "do_resize": True},
        **{"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "reduce_labels": False, "resample": 2, "size": 224},
    },
    "facebook/convnext-tiny-224": {
        "feature_extractor_type": "ConvNextFeatureExtractor",
        **{"crop_pct": 0.875, "do_normalize": True, "do_resize": True},
        **{"image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD, "resample": 3, "size": 224},
    },
    "facebook/dinov2-small": {
        "image_processor_type": "BitImageProcessor",
        **{"crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "do_convert_rgb": True},
        **{"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": IMAGENET_MEAN},
        **{"image_std": IMAGENET_STD, "resample": 3, "rescale_factor": 0.00392156862745098},
        "size": {"shortest_edge": 256},
    },
    "openai/clip-vit-base-patch32": {
        "feature_extractor_type": "CLIPFeatureExtractor",
        **{"crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True},
        **{"image_mean": CLIP_MEAN, "image_std": CLIP_STD, "resample": 3, "size": 224},
    },
    "google/siglip-base-patch16-224": {
        "image_processor_type": "SiglipImageProcessor",
        **{"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5] * 3},
        **{"image_std": [0.5] * 3, "processor_class": "SiglipProcessor", "resample": 3},
        **{"rescale_factor": 0.00392156862745098, "size": {"height": 224, "width": 224}},
    },
}
# Square, landscape and portrait; RGB, grey (L), RGBA and palette; PNG and JPEG; one smaller than every crop.
PHOTOS = [
    "astronaut.png",  # 512x512 RGB
    "chelsea.png",  # 451x300 RGB
    "coffee.png",  # 600x400 RGB
    "motorcycle_left.png",  # 741x500 RGB
    "rocket.jpg",  # 640x427 JPEG
    "camera.png",  # 512x512 grey
    "cell.png",  # 550x660 grey, portrait
    "logo.png",  # 500x500 RGBA
    "microaneurysms.png",  # 102x102 grey, upscaled
    "no_time_for_that_tiny.gif",  # 14x25 palette GIF
]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def data() -> Path:
    spec = importlib.util.find_spec("skimage")
    if spec is None:
        pytest.skip("scikit-image (the test photos) is not installed")
    return Path(spec.submodule_search_locations[0]) / "data"


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def _reference(transformers, config: dict, images: list, **kwargs) -> np.ndarray:
    """transformers' own pixel_values: the slow processor class, built from the config dict as from_pretrained does."""
    cls = getattr(transformers, ImageSpec.from_config(config).image_processor_type)
    return cls.from_dict(dict(config))(images=images, return_tensors="np", **kwargs)["pixel_values"]


def _photo(transformers, path: Path):
    """A file as transformers reads one (EXIF-transposed, RGB): what its processors are given for a path."""
    return transformers.image_utils.load_image(str(path))


@pytest.mark.parametrize("photo", PHOTOS)
@pytest.mark.parametrize("checkpoint", list(CONFIGS))
def test_pixel_values_equals_transformers_for_each_checkpoint_and_photo(data, transformers, checkpoint, photo):
    config = CONFIGS[checkpoint]
    ours = pixel_values([data / photo], ImageSpec.from_config(config))
    theirs = _reference(transformers, config, [_photo(transformers, data / photo)])
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (1, 3, 224, 224)
    assert np.abs(ours - theirs).max() <= TOLERANCE


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_pixel_values_equals_transformers_with_class_defaults(data, transformers, name):
    # The defaults table: a config naming only its class reads as that class's __init__ defaults.
    config = {"image_processor_type": name}
    ours = pixel_values([data / "coffee.png"], ImageSpec.from_config(config))
    theirs = _reference(transformers, config, [_photo(transformers, data / "coffee.png")])
    assert ours.shape == theirs.shape and np.abs(ours - theirs).max() <= TOLERANCE


@pytest.mark.parametrize("photo", ["camera.png", "logo.png", "no_time_for_that_tiny.gif"])
def test_pixel_values_equals_transformers_when_given_a_pil_image_of_another_mode(data, transformers, photo):
    from PIL import Image

    config = CONFIGS["openai/clip-vit-base-patch32"]  # do_convert_rgb: transformers converts L, RGBA, P itself
    with Image.open(data / photo) as image:
        image.load()
    assert image.mode != "RGB"
    ours = pixel_values([image], ImageSpec.from_config(config))
    assert np.abs(ours - _reference(transformers, config, [image])).max() <= TOLERANCE


@pytest.mark.parametrize("photo", ["chelsea.png", "camera.png", "logo.png"])
@pytest.mark.parametrize("checkpoint", ["facebook/dinov2-small", "google/siglip-base-patch16-224"])
def test_pixel_values_equals_transformers_when_given_arrays_bytes_and_pil(data, transformers, checkpoint, photo):
    from PIL import Image

    spec, path = ImageSpec.from_config(CONFIGS[checkpoint]), data / photo
    with Image.open(path) as image:
        array = np.asarray(image)  # HxW grey, HxWx3 RGB or HxWx4 RGBA
    theirs = _reference(transformers, CONFIGS[checkpoint], [_photo(transformers, path)])
    for given in (array, path.read_bytes(), str(path), _photo(transformers, path)):
        assert np.abs(pixel_values([given], spec) - theirs).max() <= TOLERANCE, type(given)


def test_pixel_values_equals_transformers_when_portrait(data, transformers):
    from PIL import Image

    portrait = np.asarray(Image.open(data / "motorcycle_left.png").convert("RGB")).transpose(1, 0, 2).copy()
    for checkpoint in ("facebook/convnext-tiny-224", "facebook/dinov2-small", "openai/clip-vit-base-patch32"):
        ours = pixel_values([portrait], ImageSpec.from_config(CONFIGS[checkpoint]))
        theirs = _reference(transformers, CONFIGS[checkpoint], [portrait])
        assert np.abs(ours - theirs).max() <= TOLERANCE, checkpoint


@pytest.mark.parametrize("resample", [0, 1, 2, 3, 4, 5])
def test_pixel_values_equals_transformers_for_each_resample_filter(data, transformers, resample):
    config = {**CONFIGS["google/vit-base-patch16-224"], "resample": resample, "size": {"height": 200, "width": 320}}
    ours = pixel_values([data / "chelsea.png"], ImageSpec.from_config(config))
    theirs = _reference(transformers, config, [_photo(transformers, data / "chelsea.png")])
    assert ours.shape == (1, 3, 200, 320) and np.abs(ours - theirs).max() <= TOLERANCE


@pytest.mark.parametrize(
    "change",
    [
        {"do_resize": False},  # crops of images smaller than the crop are zero-padded
        {"crop_size": {"height": 300, "width": 200}},  # taller than the resized image: padded rows, cropped columns
        {"size": {"height": 180, "width": 250}},
        {"do_rescale": False},  # normalize takes uint8 to float32 itself
        {"do_normalize": False},
        {"do_rescale": False, "do_normalize": False},
    ],
)
def test_pixel_values_equals_transformers_when_steps_change(data, transformers, change):
    config = {**CONFIGS["openai/clip-vit-base-patch32"], **change}
    for photo in ("microaneurysms.png", "chessboard_RGB.png", "coffee.png"):
        ours = pixel_values([data / photo], ImageSpec.from_config(config))
        theirs = _reference(transformers, config, [_photo(transformers, data / photo)])
        assert ours.dtype == np.float32 and np.abs(ours - theirs).max() <= TOLERANCE, photo


def test_pixel_values_equals_transformers_when_convnext_size_is_384_or_more(data, transformers):
    # From 384 up ConvNeXt warps to a square with no crop.
    config = {**CONFIGS["facebook/convnext-tiny-224"], "size": {"shortest_edge": 384}}
    ours = pixel_values([data / "coffee.png"], ImageSpec.from_config(config))
    theirs = _reference(transformers, config, [_photo(transformers, data / "coffee.png")])
    assert ours.shape == (1, 3, 384, 384) and np.abs(ours - theirs).max() <= TOLERANCE


def test_pixel_values_stacks_a_batch_of_mixed_inputs(data):
    from PIL import Image

    spec = ImageSpec.from_config(CONFIGS["facebook/dinov2-small"])
    inputs = [
        data / "chelsea.png",
        (data / "coffee.png").read_bytes(),
        Image.open(data / "camera.png"),
        np.zeros((5, 7, 3), np.uint8),
    ]
    batch = pixel_values(inputs, spec)
    assert batch.shape == (4, 3, 224, 224) and batch.dtype == np.float32 and batch.flags.c_contiguous
    assert np.array_equal(batch[1], pixel_values([data / "coffee.png"], spec)[0])


@pytest.mark.parametrize("checkpoint", list(CONFIGS))
def test_to_json_round_trips_and_reads_in_transformers(data, transformers, checkpoint):
    spec = ImageSpec.from_config(CONFIGS[checkpoint])
    written = json.loads(json.dumps(spec.to_json()))
    assert ImageSpec.from_json(written) == spec
    # The written spec is also a preprocessor_config.json that transformers reads to the same pixels.
    theirs = _reference(transformers, written, [_photo(transformers, data / "rocket.jpg")])
    assert np.abs(pixel_values([data / "rocket.jpg"], spec) - theirs).max() <= TOLERANCE


@pytest.mark.parametrize(
    ("name", "expected"),
    [("ViTFeatureExtractor", "ViTImageProcessor"), ("CLIPImageProcessorFast", "CLIPImageProcessor")],
)
def test_from_config_reads_legacy_and_fast_names_as_the_slow_class(name, expected):
    assert ImageSpec.from_config({"image_processor_type": name}).image_processor_type == expected


def _png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels, followed by a few bytes of pixel data only."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


VIT = ImageSpec.from_config(CONFIGS["google/vit-base-patch16-224"])


def test_pixel_values_refuses_a_bomb_header_before_decoding():
    # 60 Mpixel claimed by a 100-byte file: refused on the header's size (decoding would fail as truncated).
    with pytest.raises(InputError, match=r"input 0 \(its bytes\) is 10000x6000 = 60000000 pixels, over the limit"):
        pixel_values([_png(10000, 6000)], VIT)


def test_pixel_values_refuses_a_header_over_pillows_own_bomb_limit():
    with pytest.raises(InputError, match="input 0 .*decompression-bomb"):
        pixel_values([_png(40000, 40000)], VIT)


def test_pixel_values_refuses_an_image_over_max_pixels(data):
    with pytest.raises(InputError, match="input 1 .* over the limit of 1000"):
        pixel_values([np.zeros((10, 10, 3), np.uint8), data / "coffee.png"], VIT, max_pixels=1000)


def test_pixel_values_refuses_a_resize_target_over_max_pixels():
    # A 1-pixel-high sliver whose shorter side goes to 256 would be 256 x 5 120 000 pixels.
    with pytest.raises(InputError, match=r"input 0 \(20000x1\) resizes to 5120000x256; crop it"):
        pixel_values([np.zeros((1, 20000, 3), np.uint8)], ImageSpec.from_config(CONFIGS["facebook/dinov2-small"]))


@pytest.mark.parametrize(
    ("image", "match"),
    [
        (b"not an image at all", "input 0 .* is not an image Pillow can decode"),
        (_png(64, 64), "input 0 .* is not an image Pillow can decode"),  # truncated pixel data
        (np.zeros((8, 8, 3), np.float32), "input 0 is a float32 array; pass uint8"),
        (np.zeros((8, 8, 3), np.int64), "input 0 is a int64 array"),
        (np.zeros((8, 8, 3), bool), "input 0 is a bool array"),
        (np.zeros((3, 8, 8), np.uint8), r"shape \(3, 8, 8\).*transpose\(1, 2, 0\)"),
        (np.zeros((8, 8, 2), np.uint8), r"shape \(8, 8, 2\)"),
        (np.zeros((0, 8, 3), np.uint8), "input 0 is empty"),
        ("/no/such/image.png", "input 0: cannot read /no/such/image.png"),
        ("https://example.com/cat.png", "input 0 is a URL"),
        (42, "input 0 is a int, not an image"),
    ],
)
def test_pixel_values_refuses_a_bad_image(image, match):
    with pytest.raises(InputError, match=match) as raised:
        pixel_values([image], VIT)
    assert "\n" not in str(raised.value)


def test_pixel_values_names_the_bad_input_of_a_batch():
    with pytest.raises(InputError, match="input 2 .*not an image"):
        pixel_values([np.zeros((8, 8, 3), np.uint8)] * 2 + [b"GIF89a garbage"], VIT)


@pytest.mark.parametrize(
    ("images", "match"),
    [
        (np.zeros((8, 8, 3), np.uint8), "got a single ndarray; wrap it"),
        (b"\x89PNG", "got a single bytes; wrap it"),
        ([], "non-empty list"),
        (iter([]), "non-empty list"),
    ],
)
def test_pixel_values_refuses_what_is_not_a_list_of_images(images, match):
    with pytest.raises(InputError, match=match):
        pixel_values(images, VIT)


def test_pixel_values_refuses_images_of_different_sizes_when_nothing_resizes():
    spec = ImageSpec.from_config({**CONFIGS["google/vit-base-patch16-224"], "do_resize": False})
    assert pixel_values([np.zeros((5, 6, 3), np.uint8)], spec).shape == (1, 3, 5, 6)
    with pytest.raises(InputError, match="different sizes"):
        pixel_values([np.zeros((5, 6, 3), np.uint8), np.zeros((6, 5, 3), np.uint8)], spec)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"image_processor_type": "FooImageProcessor"}, "'FooImageProcessor' is not supported; supported: ViT"),
        ({"image_processor_type": 7}, "image_processor_type 7 is not supported"),
        ({"size": -1}, r"size\['height'\]=-1 must be an int from 1"),
        ({"size": {"shortest_edge": 224}}, r"size=\{'shortest_edge': 224\} is not a size this processor takes"),
        ({"size": {"longest_edge": 224}}, "is not a size this processor takes"),
        ({"size": 224.0}, "size=224.0 is not a size"),
        ({"resample": 7}, "resample=7 must be a Pillow filter code"),
        ({"resample": "bicubic"}, "resample='bicubic' must be"),
        ({"resample": True}, "resample=True must be"),
        ({"resample": None}, "resample=None must be"),
        ({"image_mean": [0.5, 0.5]}, "image_mean=.* must be 3 finite numbers"),
        ({"image_mean": [0.5, float("nan"), 0.5]}, "image_mean=.* must be 3 finite numbers"),
        ({"image_std": [0.5, 0.0, 0.5]}, "image_std=.* must be > 0"),
        ({"do_resize": "yes"}, "do_resize='yes' must be true or false"),
        ({"do_normalize": None}, "do_normalize=None must be true or false"),
        ({"rescale_factor": 0}, "rescale_factor=0 must be a number > 0"),
    ],
)
def test_from_config_refuses_a_bad_value(change, match):
    with pytest.raises(InputError, match=match) as raised:
        ImageSpec.from_config({**CONFIGS["google/vit-base-patch16-224"], **change})
    assert "\n" not in str(raised.value) and "preprocessor_config.json" in str(raised.value)


@pytest.mark.parametrize(
    ("checkpoint", "change", "match"),
    [
        ("google/siglip-base-patch16-224", {"size": 224}, r"size=\{'shortest_edge': 224\} is not a size"),
        ("facebook/convnext-tiny-224", {"size": {"height": 224, "width": 224}}, 'give {"shortest_edge": n}'),
        ("facebook/convnext-tiny-224", {"crop_pct": 1.5}, r"crop_pct=1.5 must be a number in \(0, 1\]"),
        ("openai/clip-vit-base-patch32", {"crop_size": {"shortest_edge": 224}}, "crop_size=.* is not a size"),
        ("openai/clip-vit-base-patch32", {"crop_size": 0}, r"crop_size\['height'\]=0"),
    ],
)
def test_from_config_refuses_a_size_its_class_does_not_take(checkpoint, change, match):
    with pytest.raises(InputError, match=match):
        ImageSpec.from_config({**CONFIGS[checkpoint], **change})


def test_from_config_refuses_what_is_not_a_dict_or_names_no_class():
    with pytest.raises(InputError, match="must be a JSON object, got list"):
        ImageSpec.from_config([1, 2])
    with pytest.raises(InputError, match="image_processor_type None is not supported; supported: ViTImageProcessor"):
        ImageSpec.from_config({"size": 224})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"extra": 1}, r"unknown keys \['extra'\]"),
        ({"crop_pct": ...}, r"lacks \['crop_pct'\]"),
        ({"resample": 9}, "resample=9 must be"),
    ],
)
def test_from_json_refuses_anything_but_what_to_json_writes(change, match):
    written = ImageSpec.from_config(CONFIGS["openai/clip-vit-base-patch32"]).to_json() | change
    written = {key: value for key, value in written.items() if value is not ...}
    with pytest.raises(ArtifactError, match=match):
        ImageSpec.from_json(written)


def test_labels_from_config_reads_id2label_in_id_order():
    assert labels_from_config({"id2label": {"1": "dog", "0": "cat", "2": "bird"}}) == ["cat", "dog", "bird"]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({}, "no id2label"),
        ({"id2label": {"0": "cat", "2": "dog"}}, r"ids must be 0 to 1 once each; missing \[1\]"),
        ({"id2label": {"zero": "cat"}}, "key 'zero' is not a class id"),
        ({"id2label": {"0": 5}}, r"id2label\['0'\]=5 must be a string"),
    ],
)
def test_labels_from_config_refuses_a_bad_id2label(config, match):
    with pytest.raises(InputError, match=match):
        labels_from_config(config)


def test_top_k_gives_softmax_probabilities_most_probable_first():
    got = top_k(np.array([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]]), 2, ["a", "b", "c"])
    total = math.exp(1) + math.exp(3) + math.exp(2)
    assert [p.label for p in got[0]] == ["b", "c"] and got[0][0].score == pytest.approx(math.exp(3) / total)
    assert got[1][0] == Prediction("c", pytest.approx(math.exp(5) / (2 + math.exp(5))))
    # k over the class count gives every class; huge logits do not overflow; ties keep class order.
    assert [p.label for p in top_k([[1e4, 1e4, -1e4]], 10, ["a", "b", "c"])[0]] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("logits", "k", "error", "match"),
    [
        (np.zeros(3), 1, InputError, r"logits \[batch, classes\], got shape \(3,\)"),
        (np.zeros((1, 4)), 1, ArtifactError, "4 logits a row but its config names 3 labels"),
        (np.zeros((1, 3)), 0, InputError, "k=0 must be an int >= 1"),
        (np.array([[0.0, 1.0, 2.0], [np.nan, 0.0, 0.0]]), 1, InputError, r"rows \[1\] hold NaN or inf"),
    ],
)
def test_top_k_refuses_bad_logits(logits, k, error, match):
    with pytest.raises(error, match=match):
        top_k(logits, k, ["a", "b", "c"])


def test_images_module_imports_no_torch_transformers_or_pillow_until_it_resizes():
    code = (
        "import sys, numpy as np\n"
        "import pipeline.runtime.images as images\n"
        "heavy = {'torch', 'transformers', 'onnx', 'PIL'}\n"
        "assert not heavy & set(sys.modules), heavy & set(sys.modules)\n"
        "spec = images.ImageSpec.from_config({'image_processor_type': 'CLIPImageProcessor'})\n"
        "assert images.pixel_values([np.zeros((30, 40, 3), np.uint8)], spec).shape == (1, 3, 224, 224)\n"
        "assert 'PIL' in sys.modules and not {'torch', 'transformers', 'onnx'} & set(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_pixel_values_reads_bytearray_and_memoryview_as_file_bytes(data):
    # bytearray and memoryview are file bytes too.
    raw = (data / "rocket.jpg").read_bytes()
    spec = ImageSpec.from_config(CONFIGS["facebook/deit-small-patch16-224"])
    expected = pixel_values([raw], spec)
    assert np.array_equal(pixel_values([bytearray(raw), memoryview(raw)], spec), np.concatenate([expected] * 2))
