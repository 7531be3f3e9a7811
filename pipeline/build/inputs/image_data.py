"""The default held-out and calibration images of an image model: scikit-image's photographs, cropped.

A build of an image model given no --validation or --calibration data uses these, as a text model uses
data/validation.txt and data/calibration.txt. scikit-image ships about two dozen real pictures (an astronaut, a
cat, coffee, a rocket, micrographs, textures); each becomes its whole frame and three crops of three quarters of
it, so that the sets are large enough to judge candidates on. Held out means held out by picture: the pictures
alternate between the two sets, so no crop of a calibration picture is validated on.

The files are written once into `<cache>/.images/<digest>/{validation,calibration}/` (written beside, then
renamed into place), where the digest covers the source files and the cropping.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pipeline.build.inputs.data import written_once
from pipeline.errors import InputError

VERSION = 2
SUFFIXES = (".png", ".jpg")
MIN_SIDE = 64  # smaller pictures (an icon, a 10x15 test page) say little about a model
CROP = 0.75


def _sources() -> list[Path]:
    """scikit-image's photographs, sorted by name."""
    try:
        import skimage
    except ImportError:
        raise InputError(
            "an image model's default validation and calibration images come from scikit-image; install it "
            "(pip install 'pipeline[build]') or pass --validation and --calibration folders of images"
        ) from None
    from PIL import Image

    folder = Path(skimage.__file__).parent / "data"
    found = []
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() in SUFFIXES and path.is_file():
            with Image.open(path) as image:
                if min(image.size) >= MIN_SIDE:
                    found.append(path)
    return found


def _rgb(path: Path):
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def _views(path: Path, rgb, out: Path) -> None:
    """The whole picture and three crops of it (centre, top left, bottom right), as PNG files in `out`."""
    width, height = rgb.size
    w, h = int(width * CROP), int(height * CROP)
    boxes = {
        "full": (0, 0, width, height),
        "centre": ((width - w) // 2, (height - h) // 2, (width + w) // 2, (height + h) // 2),
        "top-left": (0, 0, w, h),
        "bottom-right": (width - w, height - h, width, height),
    }
    for name, box in boxes.items():
        rgb.crop(box).save(out / f"{path.stem}-{name}.png")


def default_image_data(cache_dir) -> tuple[Path, Path]:
    """(validation folder, calibration folder) of the default images, written under `cache_dir` on first use."""
    sources = _sources()
    digest = hashlib.sha256(f"{VERSION} {CROP} {MIN_SIDE}".encode())
    for path in sources:
        digest.update(f"{path.name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())

    def write(scratch: Path) -> None:
        seen: set = set()  # one picture shipped twice (a grey and an RGB chessboard) would be in both sets
        for path in sources:
            rgb = _rgb(path)
            if (pixels := hashlib.sha256(rgb.tobytes()).hexdigest()) in seen:
                continue
            seen.add(pixels)
            split = scratch / ("calibration" if len(seen) % 2 == 1 else "validation")
            split.mkdir(exist_ok=True)
            _views(path, rgb, split)

    final = written_once(Path(cache_dir) / ".images" / digest.hexdigest()[:16], write)
    return final / "validation", final / "calibration"
