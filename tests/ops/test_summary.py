"""The build's printed tables: the candidate table keeps its columns aligned whatever the candidates' names."""

from pipeline.ops.summary import candidate_table


def test_candidate_columns_line_up_with_a_name_longer_than_the_default_width():
    rows = [
        {"name": "ort-fp32", "status": "passed", "cosine_min": 1.0, "latency_ms": {"batch_1": 10.0}},
        {
            "name": "openvino-int8-dynamic-long",
            "status": "passed",
            "cosine_min": 0.9974,
            "latency_ms": {"batch_1": 4.5},
        },
        {"name": "x", "status": "missed", "cosine_min": 0.5, "latency_ms": None, "chosen": False},
    ]
    rows[1]["chosen"] = True
    lines = candidate_table({"candidates": rows}).splitlines()
    status_at = {line.index(word) for line, word in zip(lines, ("status", "passed", "passed", "missed"), strict=True)}
    assert len(status_at) == 1 and lines[2].endswith("<- chosen")
    assert lines[1].split()[:2] == ["ort-fp32", "passed"] and lines[2].split()[0] == "openvino-int8-dynamic-long"
