import pytest

from pipeline.bench.serving import TRITON_ENV, concurrency, markdown
from pipeline.runtime import load
from tests.conftest import SMALL_TEXTS


def test_drive_counts_each_callers_requests_and_their_latency():
    from pipeline.bench.serving import drive

    def make_call():
        def call(text):
            if text == "boom":
                raise RuntimeError("no")

        return call

    row = drive(make_call, ["a", "boom"], callers=2, seconds=0.2)
    assert row["requests"] > 2 and row["errors"] > 0 and row["requests_per_s"] > 0


@pytest.mark.slow  # tritonserver and Ray Serve, each started live
def test_serving_bench_measures_every_engine_at_each_concurrency(published_fp32):
    if not (TRITON_ENV / ".installed").exists():
        pytest.skip("no .venv-triton with nvidia-pytriton's tritonserver: make triton-env")
    pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra")
    results = concurrency(load(published_fp32), published_fp32, SMALL_TEXTS, callers=(1, 4), seconds=0.5)
    assert not results["missing"]
    got = [(r["variant"], r["callers"]) for r in results["rows"]]
    assert got == [(v, n) for v in ("direct", "batcher", "triton-python", "ray-serve") for n in (1, 4)]
    assert all(r["requests"] > 0 and r["errors"] == 0 for r in results["rows"]), results["rows"]
    assert "| ray-serve | 4 |" in "\n".join(markdown(results))


@pytest.mark.slow  # the other servers still start live
def test_a_server_that_cannot_start_is_a_missing_row_and_the_rest_is_measured(published_fp32, tmp_path, monkeypatch):
    from pipeline.bench import serving

    (tmp_path / ".installed").touch()  # an environment that says it is installed but has no Python at all
    monkeypatch.setattr(serving, "TRITON_ENV", tmp_path)
    results = concurrency(load(published_fp32), published_fp32, SMALL_TEXTS, callers=(1,), seconds=0.2)
    assert "no Python environment" in results["missing"]["triton-python"]
    assert [r["variant"] for r in results["rows"]][:2] == ["direct", "batcher"]
    assert "- triton-python: not measured (it did not start: " in "\n".join(markdown(results))
