"""Helpers both searches' tests use (encoders in test_search, decoders in
tests/build/search/test_decoders.py)."""

from pipeline.build.table import build


def build_into(checkpoint, target, texts_file, calibration_file, folder):
    """Build `checkpoint` for `target` with the test texts, its artifacts and cache under `folder`."""
    return build(
        checkpoint,
        str(target),
        validation=texts_file,
        calibration=calibration_file,
        artifacts_dir=folder / "a",
        cache_dir=folder / "c",
    )


def assert_chosen_is_the_fastest_that_passed_held_out(rows: list[dict]) -> None:
    """The chosen row passed on both splits; every faster row that passed the development split missed on
    held-out text, and no slower row was held to it."""
    [chosen] = [r for r in rows if r["chosen"]]
    assert chosen["status"] == "passed" and chosen["held_out"]["status"] == "passed"
    for row in rows:
        if row["status"] == "passed" and row is not chosen:
            faster = row["score"] < chosen["score"]
            assert (row.get("held_out") or {}).get("status") == ("missed" if faster else None)
