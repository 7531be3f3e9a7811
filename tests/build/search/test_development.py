"""The development split: every fourth calibration example held back, filled up from the repository's text where
the user's split is too small to judge on."""

import dataclasses

from pipeline.build.inputs.data import DEFAULT_CALIBRATION, DEFAULT_VALIDATION, read_texts
from pipeline.build.inputs.targets import load_target
from pipeline.build.manifest import Checkpoint, Manifest
from pipeline.build.search.development import MIN_DEVELOPMENT, development_split, filled_examples


def test_development_split_fills_a_small_split_with_repository_text_only_where_unseen(tmp_path):
    own = read_texts(DEFAULT_CALIBRATION, "calibration")
    held_out = set(read_texts(DEFAULT_VALIDATION, "validation"))
    user = [f"a short user sentence number {i}." for i in range(56)] + own[-4:]  # four lines the repository has
    manifest = Manifest("m", "", "", "", str(DEFAULT_VALIDATION), "")
    manifest = dataclasses.replace(manifest, checkpoint=Checkpoint("", "", "bert", "feature-extraction", {}, None, 128))
    target = load_target("cpu-avx2-static")
    calibration, development = development_split(user, manifest, target)
    assert calibration == development_split(user)[0] and len(development) == MIN_DEVELOPMENT
    added = development[len(user) // 4 :]
    assert filled_examples(user, development) == len(added) == MIN_DEVELOPMENT - 15
    assert not set(added) & (set(user) | held_out) and set(added) <= set(own)
    large = own[:256]
    assert development_split(large, manifest, target) == development_split(large)
