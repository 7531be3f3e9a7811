"""`pipeline check`: what a build would do, from the checkpoint and the target, without building."""

import json
import shutil
import subprocess
import sys

import pytest

from pipeline.errors import InputError
from pipeline.ops.check import check


def test_check_names_task_family_passes_and_candidates_of_an_encoder(tiny_bert):
    plan = check(tiny_bert, "cpu-avx2")
    assert (plan["model_type"], plan["family"], plan["task"]) == ("bert", "encoder", "feature-extraction")
    assert plan["passes"] == "onnxruntime bert fusions" and plan["attention"] == "exported as is"
    assert [c["name"] for c in plan["candidates"]][:2] == ["ort-fp32", "ort-int8-dynamic"]


def test_check_says_a_decoder_gets_group_query_attention(tiny_gpt2):
    plan = check(tiny_gpt2, "cpu-fp32")
    assert plan["family"] == "decoder" and plan["task"] == "text-generation"
    assert plan["attention"] == "GroupQueryAttention (gpt2 layout)" and plan["candidates"] == []


def test_check_refuses_remote_code_before_anything_else(tiny_bert, tmp_path):
    folder = tmp_path / "remote"
    shutil.copytree(tiny_bert, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "modeling.Custom"}}))
    with pytest.raises(InputError, match="never runs code from a checkpoint folder"):
        check(folder, "cpu-avx2")


def test_cli_check_prints_the_plan_in_one_call(tiny_bert):
    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "check", str(tiny_bert), "--target", "cpu-fp32"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert (
        "bert (encoder, known family), task feature-extraction" in out.stdout
        and "passes      onnxruntime" in out.stdout
    )
