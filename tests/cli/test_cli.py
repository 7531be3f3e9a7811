import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_targets_lists_every_target():
    out = _cli("targets")
    assert out.returncode == 0
    names = [line.split()[0] for line in out.stdout.splitlines()]
    assert names == [
        "a100",
        "cpu-amx",
        "cpu-avx2",
        "cpu-avx2-dynamic",
        "cpu-avx2-static",
        "cpu-avx512",
        "cpu-fp32",
        "cpu-int8-weights",
        "h100",
        "l4",
    ]


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--target", "cpu-avx9"], 2, "unknown target 'cpu-avx9'"),
        (["--model", "/nonexistent/ckpt"], 3, "is not a folder"),
        (["--task", "translation"], 3, "task 'translation' is not supported"),
        (["--task", ""], 3, "--task is empty; pass a value"),
        (["--models", ""], 3, "--models is empty"),
        (["--targets", ",,"], 3, "--targets ',,' names no target"),
        (["--target", "cpu-fp32", "--targets", "cpu-avx2"], 3, "--target does not go with --targets"),
        (["--name", "n", "--targets", "cpu-fp32"], 3, "--name does not go with --targets"),
        (["--target", "tt.toml"], 2, "cannot read target file"),  # a folder named like a target file
    ],
)
def test_cli_build_bad_input_is_one_line_error(args, code, message, tiny_bert, tmp_path):
    if "--model" not in args:
        args = ["--model", str(tiny_bert), *args]
    (tmp_path / "tt.toml").mkdir()
    args = [str(tmp_path / a) if a == "tt.toml" else a for a in args]
    out = _cli("build", *args, "--artifacts-dir", str(tmp_path / "a"), "--cache-dir", str(tmp_path / "c"))
    assert out.returncode == code, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "a").exists() or not list((tmp_path / "a").rglob("manifest.json"))


@pytest.mark.parametrize(
    "option, content, message",
    [
        ("--validation", b"\n", "holds no examples"),
        ("--calibration", b"\n \n", "calibration data"),
        ("--calibration", b"ok\ncaf\xe9\n", "line 2: not UTF-8"),
    ],
)
def test_cli_build_bad_data_file_publishes_nothing(
    option, content, message, tiny_bert, texts_file, calibration_file, tmp_path
):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    data = {"--validation": str(texts_file), "--calibration": str(calibration_file), option: str(bad)}
    out = _cli(
        "build",
        "--model",
        str(tiny_bert),
        *[x for kv in data.items() for x in kv],
        "--artifacts-dir",
        str(tmp_path / "a"),
        "--cache-dir",
        str(tmp_path / "c"),
    )
    assert out.returncode == 3 and message in out.stderr and str(bad) in out.stderr
    assert not list((tmp_path / "a").rglob("manifest.json"))


def test_cli_build_then_inspect(tiny_bert, texts_file, calibration_file, tmp_path):
    common = [
        "--model",
        str(tiny_bert),
        "--target",
        "cpu-avx2-dynamic",
        "--validation",
        str(texts_file),
        "--calibration",
        str(calibration_file),
        "--artifacts-dir",
        str(tmp_path / "a"),
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    first = _cli("build", *common)
    assert first.returncode == 0, first.stderr
    assert "published" in first.stdout and "v1/cpu-avx2-dynamic" in first.stdout
    second = _cli("build", *common)
    assert "unchanged" in second.stdout and "reused stages: export, optimize, quantize, validate, tune" in second.stdout
    folder = str(tmp_path / "a" / "tiny-bert" / "latest" / "cpu-avx2-dynamic")
    shown = _cli("inspect", "--json", folder)
    assert shown.returncode == 0
    assert json.loads(shown.stdout)["verified"] is True
    summary = _cli("inspect", folder)
    assert summary.returncode == 0 and "tiny-bert v1 for cpu-avx2-dynamic: feature-extraction" in summary.stdout
    assert "every sha256 verified" in summary.stdout and "validation on held-out data:" in summary.stdout
    assert "cosine_min" in summary.stdout and "PASS" in summary.stdout and '"files"' not in summary.stdout


def test_cli_inspect_refuses_tampered_artifact(artifact_copy):
    (artifact_copy / "tokenizer.json").write_text("{}")
    out = _cli("inspect", str(artifact_copy))
    assert out.returncode == 7 and "tokenizer.json does not match its sha256" in out.stderr


def test_cli_generate_shows_each_prompt_then_streams_its_text_then_its_end(published_gpt2):
    from pipeline.runtime import load

    prompts = ["The cat sat", "How do I"]
    # One prompt at a time, as the CLI runs them: dynamic int8 depends on what shares a batch.
    expected = load(published_gpt2).generate(prompts, max_new_tokens=12, batch_size=1)
    out = _cli("generate", str(published_gpt2), *prompts, "--max-new-tokens", "12")
    assert out.returncode == 0, out.stderr
    assert "\x1b[" not in out.stdout  # no styling off a terminal
    assert out.stdout == "\n".join(
        f"--- prompt {i + 1} of 2\n{p}{c.text}\n[{c.finish_reason}]\n"
        for i, (p, c) in enumerate(zip(prompts, expected, strict=True))
    )
    single = _cli("generate", str(published_gpt2), "The cat sat", "--max-new-tokens", "12")
    assert single.stdout == f"The cat sat{expected[0].text}\n[{expected[0].finish_reason}]\n"


def test_cli_generate_refuses_encoder_artifact_and_bad_settings(published, published_gpt2):
    out = _cli("generate", str(published), "hello")
    assert out.returncode == 1
    assert (
        "is a feature-extraction artifact; generate needs a text-generation or text2text-generation one" in out.stderr
    )
    out = _cli("generate", str(published_gpt2), "hello", "--top-p", "2")
    assert out.returncode == 3 and "top_p=2.0 must be a number in (0, 1]" in out.stderr


@pytest.mark.parametrize("seed", ["abc", "-1", "1.5"])
def test_cli_generate_refuses_a_bad_seed_in_one_line_naming_the_range(published_gpt2, seed):
    out = _cli("generate", str(published_gpt2), "hello", "--max-new-tokens", "2", "--seed", seed)
    assert out.returncode == 3, out.stderr
    assert "must be an int from 0 to 2**64 - 1" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_cli_targets_lists_the_good_targets_and_names_a_broken_file(tmp_path):
    import shutil

    folder = tmp_path / "targets"
    shutil.copytree(REPO / "targets", folder)
    (folder / "broken.toml").write_text("name = [unclosed\n")
    out = _cli("targets", "--targets-dir", str(folder))
    assert out.returncode == 2
    assert "cpu-fp32" in out.stdout and "a100" in out.stdout
    assert "broken.toml: not valid TOML" in out.stderr
    (folder / "sub.toml").mkdir()  # a folder named like a target file is not one
    assert "sub" not in _cli("targets", "--targets-dir", str(folder)).stdout.split()
    for missing in (tmp_path / "nothing", folder / "cpu-fp32.toml"):
        out = _cli("targets", "--targets-dir", str(missing))
        assert out.returncode == 2 and "is not a folder" in out.stderr


def test_cli_version_prints_the_package_version():
    out = _cli("--version")
    assert out.returncode == 0 and "pipeline, version 0.1.0" in out.stdout


def test_makefile_quotes_every_value_it_passes_to_the_cli():
    out = subprocess.run(
        ["make", "-n", "build", "MODEL=/tmp/a b/My Model", "NAME=x", "CALIBRATION=/tmp/c d.txt"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    line = next(row for row in out.stdout.splitlines() if "pipeline build" in row)
    assert '--model "/tmp/a b/My Model"' in line and '--calibration "/tmp/c d.txt"' in line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--name", "../../x"], "Triton model name '../../x' must be"),
        (["--name", "ok"], "is a file, not a folder"),
    ],
)
def test_cli_export_triton_bad_name_or_out_dir_is_one_line_error(args, message, published, tmp_path):
    out_dir = tmp_path / "repo"
    if "ok" in args:
        out_dir.write_text("a file where the repository should go")
    out = _cli("export", "triton", str(published), str(out_dir), *args)
    assert out.returncode == 3, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert not (tmp_path.parent / "x").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["serve", "x", "--port", "abc"], "error: Invalid value for '--port': 'abc' is not a valid integer"),
        (["build", "--no-such-option"], "error: No such option '--no-such-option'"),
        (["no-such-command"], "error: No such command 'no-such-command'"),
        (["--bogus"], "error: No such option '--bogus'"),
    ],
)
def test_cli_usage_errors_are_one_line_naming_the_help(args, message):
    out = _cli(*args)
    assert out.returncode == 2
    assert out.stderr.startswith(message) and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--help` lists the options" in out.stderr


def test_cli_inspect_prints_no_control_characters_from_the_manifest(artifact_copy):
    from tests.conftest import edit_manifest

    edit_manifest(artifact_copy, lambda m: m.update(created_at="\x1b[2J\x1b]0;pwned\x07today\r"))
    out = _cli("inspect", str(artifact_copy))
    assert out.returncode == 0, out.stderr
    assert "today" in out.stdout and not any(c in out.stdout for c in "\x1b\x07\r")


def test_cli_inspect_refuses_a_search_table_of_another_shape_in_one_line(artifact_copy):
    from tests.conftest import edit_manifest

    edit_manifest(artifact_copy, lambda m: m.update(candidates=[1, 2]))
    out = _cli("inspect", str(artifact_copy))
    assert out.returncode == 7 and "not of the shape this version writes" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_cli_inspect_shows_the_search_timings_beside_the_accuracy(published_openvino):
    out = _cli("inspect", str(published_openvino))
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.strip().startswith("openvino-fp32"))
    assert "batch_1 ms" in out.stdout and "nan" not in row and "times on the build host" in out.stdout
