"""Shared fixtures: tiny random checkpoints made with save_pretrained, and tiny targets.

The tiny models borrow the real MiniLM tokenizer (so text tokenizes into real word pieces) and have random
weights of a few hundred thousand parameters, so a whole build takes seconds.
"""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from pipeline.checkpoint import default_checkpoint

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
HEADS = {
    "feature-extraction": "AutoModel",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
}
SMALL_TEXTS = [
    "The cat sat on the mat.",
    "A cat was sitting on the mat.",
    "Stock markets fell sharply on Tuesday.",
    "How do I reset my password?",
    "Preheat the oven to 180 degrees.",
    "The committee postponed its decision until next spring, citing the need for more public consultation.",
    "ok",
    "Zürich is expensive, but the café was lovely.",
    "Photosynthesis turns light into chemical energy.",
    "Please close the door when you leave the room.",
    "The train to Berlin was delayed by forty minutes because of a signal failure near the border.",
    "I disagree.",
]


def tiny_config(model_type: str, task: str):
    """A small random config of the family; classifier heads get three labels."""
    from transformers import AutoConfig

    common = {"vocab_size": 30522, "max_position_embeddings": 128}
    sizes = {
        "bert": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64},
        "electra": {
            "hidden_size": 32, "embedding_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 64,
        },
        "roberta": {
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
            "pad_token_id": 0, "max_position_embeddings": 130, "type_vocab_size": 1,
        },
        "distilbert": {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64, "pad_token_id": 0},
    }[model_type]  # fmt: skip
    config = AutoConfig.for_model(model_type, **{**common, **sizes})
    if task != "feature-extraction":
        config.num_labels = 3
        config.id2label = {0: "neg", 1: "neu", 2: "pos"}
        config.label2id = {v: k for k, v in config.id2label.items()}
    return config


def make_checkpoint(folder: Path, model_type: str = "bert", task: str = "feature-extraction", seed: int = 0) -> Path:
    """Save a tiny random checkpoint of `model_type` for `task` into `folder`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(model_type, task)
    model = getattr(transformers, HEADS[task]).from_config(config)
    model.eval().save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copyfile(default_checkpoint() / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    """A tiny random BERT for feature extraction (mean pooling, no sentence-transformers config)."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-bert")


@pytest.fixture(scope="session")
def texts_file(tmp_path_factory) -> Path:
    """A small held-out text file for fast builds."""
    path = tmp_path_factory.mktemp("data") / "texts.txt"
    path.write_text("\n".join(SMALL_TEXTS) + "\n", encoding="utf-8")
    return path


def _toml_value(value) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


def write_target(folder: Path, name: str, base: str = "cpu-avx2", **overrides) -> Path:
    """A copy of a shipped target under a new name; overrides are `section__key=value` (or `key=value`)."""
    table = tomllib.loads((REPO / "targets" / f"{base}.toml").read_text())
    table["name"] = name
    for dotted, value in overrides.items():
        section, _, key = dotted.rpartition("__")
        (table.setdefault(section, {}) if section else table)[key] = value
    lines = [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for section, values in table.items():
        if isinstance(values, dict):
            lines += [f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    path = folder / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def build_dirs(tmp_path) -> dict:
    """Fresh artifact and cache folders for one test."""
    return {"artifacts_dir": tmp_path / "artifacts", "cache_dir": tmp_path / "cache"}


@pytest.fixture(scope="session")
def published(tiny_bert, texts_file, tmp_path_factory) -> Path:
    """One artifact of the tiny BERT, built once per session. Copy it before changing it."""
    from pipeline.build import build

    root = tmp_path_factory.mktemp("published")
    manifest = build(
        tiny_bert, "cpu-avx2", artifacts_dir=root / "artifacts", cache_dir=root / "cache",
        validation=texts_file, calibration=texts_file,
    )  # fmt: skip
    return Path(manifest.published["path"])


@pytest.fixture
def artifact_copy(published, tmp_path) -> Path:
    """A writable copy of the session's artifact, laid out as <model>/<version>/<target>."""
    copy = tmp_path / "tiny-bert" / published.parent.name / published.name
    shutil.copytree(published, copy)
    for file in copy.iterdir():
        file.chmod(0o644)
    return copy
