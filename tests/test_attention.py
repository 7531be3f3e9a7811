"""The GroupQueryAttention rewrite of Llama-style decoder exports: what the graph holds before and after."""

from collections import Counter

import onnx
import pytest

from pipeline.manifest import Checkpoint
from pipeline.stages.export import onnx_from_checkpoint

from .tiny import make_decoder


def _export(tmp_path, model_type: str, **config) -> tuple[dict, onnx.ModelProto]:
    import json

    folder = make_decoder(tmp_path / model_type, model_type, **config)
    config = json.loads((folder / "config.json").read_text())
    checkpoint = Checkpoint(path=str(folder), digest="test", task="text-generation", model_type=model_type,
                            config=config, pooling=None, max_length=256)  # fmt: skip
    out = tmp_path / "export"
    out.mkdir()
    metrics = onnx_from_checkpoint(checkpoint, out)
    return metrics, onnx.load(str(out / "model.onnx"))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_llama_style_attention_becomes_one_group_query_attention_per_layer(model_type, tmp_path):
    metrics, graph = _export(tmp_path, model_type)
    ops = Counter(n.op_type for n in graph.graph.node)
    attention = metrics["attention"]
    assert attention["op"] == "GroupQueryAttention" and attention["layers"] == 2
    assert attention["nodes_after"] == len(graph.graph.node) < attention["nodes_before"] / 4
    assert ops["GroupQueryAttention"] == 2
    # Q/K/V packed: per layer one projection MatMul and o_proj, plus the MLP's three and the LM head.
    assert ops["MatMul"] == 2 * (2 + 3) + 1
    # Rotary (Neg of the rotate-half), the KV-head repeat and the softmax are inside the op now.
    assert ops["Neg"] == ops["Softmax"] == ops["Range"] == 0
    gqa = next(n for n in graph.graph.node if n.op_type == "GroupQueryAttention")
    assert {a.name: a.i for a in gqa.attribute} == {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1}
    assert "position_ids" not in [i.name for i in graph.graph.input]
    assert metrics["spec"]["cache"] == "shared" and metrics["probe_max_abs_diff"] < 1e-4
    if model_type == "qwen2":  # the q, k and v biases are packed too
        assert sum(n.name.endswith("qkv_proj/Add") for n in graph.graph.node) == 2


def test_gpt2_attention_becomes_group_query_attention_with_as_many_kv_heads_as_heads(tmp_path):
    metrics, graph = _export(tmp_path, "gpt2")
    ops = Counter(n.op_type for n in graph.graph.node)
    assert metrics["attention"]["op"] == "GroupQueryAttention" and metrics["spec"]["cache"] == "shared"
    assert ops["GroupQueryAttention"] == 2 and ops["Softmax"] == ops["Where"] == 0
    gqa = next(n for n in graph.graph.node if n.op_type == "GroupQueryAttention")
    assert {a.name: a.i for a in gqa.attribute} == {"num_heads": 4, "kv_num_heads": 4, "do_rotary": 0}
    assert gqa.input[0].endswith("c_attn/Reshape_1_output_0")  # c_attn's packed Q/K/V, as it was
    assert metrics["attention"]["nodes_after"] < metrics["attention"]["nodes_before"] * 0.6


def test_gpt_neox_attention_becomes_group_query_attention_with_its_partial_rotary_inside(tmp_path):
    # Head size 32, rotary_pct 0.5: 16 of each head's dimensions rotate, as Pythia's 16 of 64.
    metrics, graph = _export(tmp_path, "gpt_neox", hidden_size=128)
    ops = Counter(n.op_type for n in graph.graph.node)
    assert metrics["attention"]["op"] == "GroupQueryAttention" and metrics["spec"]["cache"] == "shared"
    assert metrics["attention"]["nodes_after"] < metrics["attention"]["nodes_before"] / 4
    assert ops["GroupQueryAttention"] == 2 and ops["Softmax"] == ops["Neg"] == 0
    # Per layer query_key_value (its columns reordered), dense and the MLP's two, plus the LM head.
    assert ops["MatMul"] == 2 * (2 + 2) + 1
    gqa = next(n for n in graph.graph.node if n.op_type == "GroupQueryAttention")
    assert {a.name: a.i for a in gqa.attribute} == {"num_heads": 4, "kv_num_heads": 4, "do_rotary": 1}
    assert gqa.input[0].endswith("qkv_proj/biased")
    cos = next(i for i in graph.graph.initializer if i.name == gqa.input[7])
    assert list(cos.dims) == [256, 8]  # max length, half the 16 rotary dimensions
    assert metrics["probe_max_abs_diff"] < 1e-4


def test_gpt_neox_whose_rotary_width_the_kernel_refuses_keeps_its_attention_and_says_why(tmp_path):
    metrics, graph = _export(tmp_path, "gpt_neox")  # head size 16, 8 rotary dimensions
    assert metrics["attention"]["op"] is None and "8 rotary dimensions" in metrics["attention"]["why"]
    assert metrics["spec"]["cache"] == "concat"
    assert not any(n.domain == "com.microsoft" for n in graph.graph.node)
