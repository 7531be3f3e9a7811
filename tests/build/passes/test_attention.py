"""The GroupQueryAttention rewrite of Llama-style decoder exports: what the graph holds before and after."""

from collections import Counter

import onnx
import pytest

from pipeline.build.manifest import Checkpoint
from pipeline.build.stages.export import onnx_from_checkpoint
from tests.tiny import make_decoder


def _export(tmp_path, model_type: str, **config) -> tuple[dict, onnx.ModelProto]:
    import json

    folder = make_decoder(tmp_path / model_type, model_type, **config)
    config = json.loads((folder / "config.json").read_text())
    checkpoint = Checkpoint(
        path=str(folder),
        digest="test",
        task="text-generation",
        model_type=model_type,
        config=config,
        pooling=None,
        max_length=256,
    )
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


def _gqa_nodes(graph) -> list:
    return [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]


def _attributes(node) -> dict:
    return {a.name: round(a.f, 6) if a.type == onnx.AttributeProto.FLOAT else a.i for a in node.attribute}


def _prompt_logits(folder, graph, ids) -> tuple:
    """Last-position logits of the graph and of transformers on one unpadded prompt."""
    import numpy as np
    import onnxruntime as ort
    import torch
    import transformers

    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        expected = model(torch.from_numpy(ids)).logits[:, -1].numpy()
    return session.run(None, feeds)[0][:, -1], expected


def test_sliding_window_becomes_local_window_size_of_exactly_the_window_and_one_less_or_more_differs(tmp_path):
    import numpy as np

    metrics, graph = _export(tmp_path, "mistral")  # sliding_window 8
    assert metrics["attention"]["op"] == "GroupQueryAttention" and metrics["probe_max_abs_diff"] < 1e-4
    assert [_attributes(n)["local_window_size"] for n in _gqa_nodes(graph)] == [8, 8]
    ids = (np.arange(40, dtype=np.int64)[None] * 7 + 3) % 500  # 40 tokens: five windows
    got, expected = _prompt_logits(tmp_path / "mistral", graph, ids)
    assert np.abs(got - expected).max() < 1e-4
    for size in (7, 9):  # ONNX Runtime 1.32's CPU kernel: local_window_size keys, the query's own included
        for node in _gqa_nodes(graph):
            next(a for a in node.attribute if a.name == "local_window_size").i = size
        got, expected = _prompt_logits(tmp_path / "mistral", graph, ids)
        assert np.abs(got - expected).max() > 1e-2, size


def test_gemma2_attention_keeps_its_scale_softcap_and_window_in_the_op_and_final_softcap_in_the_graph(tmp_path):
    metrics, graph = _export(tmp_path, "gemma2")  # query_pre_attn_scalar 24, softcaps 5 and 3, window 8 on layer 0
    scale = round(24**-0.5, 6)
    assert [_attributes(n) for n in _gqa_nodes(graph)] == [
        {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1, "scale": scale, "softcap": 5.0, "local_window_size": 8},
        {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1, "scale": scale, "softcap": 5.0},
    ]
    ops = Counter(n.op_type for n in graph.graph.node)
    assert ops["Softmax"] == 0 and ops["Tanh"] == 2 + 1  # the MLPs' tanh Gelu, and the final logit softcapping
    assert metrics["last_token_logits"] and metrics["probe_max_abs_diff"] < 1e-4


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2", "gemma3_text"])
def test_q_k_norms_stay_in_the_graph_and_feed_the_op_separate_query_key_value(model_type, tmp_path):
    metrics, graph = _export(tmp_path, model_type)
    nodes = _gqa_nodes(graph)
    assert metrics["attention"]["op"] == "GroupQueryAttention" and len(nodes) == metrics["attention"]["layers"]
    assert all(n.input[0] and n.input[1] and n.input[2] for n in nodes)
    assert all(n.input[2].endswith("v_proj/MatMul_output_0") for n in nodes)
    assert sum("/q_norm/" in n.name for n in graph.graph.node) >= len(nodes)  # the norms, as exported
    assert Counter(n.op_type for n in graph.graph.node)["Softmax"] == 0
    assert metrics["probe_max_abs_diff"] < 1e-4


def test_gemma3_sliding_layers_read_the_local_rotary_and_the_global_layer_its_own(tmp_path):
    metrics, graph = _export(tmp_path, "gemma3_text")  # layers: sliding, sliding, full
    nodes = _gqa_nodes(graph)
    assert [n.input[7] for n in nodes] == ["gqa/rotary_emb_local/cos"] * 2 + ["gqa/rotary_emb/cos"]
    assert [_attributes(n).get("local_window_size") for n in nodes] == [8, 8, None]
    assert {_attributes(n)["scale"] for n in nodes} == {round(24**-0.5, 6)}
    assert metrics["probe_max_abs_diff"] < 1e-4


def test_phi3_packed_qkv_proj_feeds_the_op_as_it_is(tmp_path):
    metrics, graph = _export(tmp_path, "phi3")
    nodes = _gqa_nodes(graph)
    assert len(nodes) == 2 and all(n.input[0].endswith("qkv_proj/MatMul_output_0") and not n.input[1] for n in nodes)
    assert Counter(n.op_type for n in graph.graph.node)["MatMul"] == 2 * (2 + 2) + 1  # qkv, o, gate_up, down; head
    assert metrics["probe_max_abs_diff"] < 1e-4


def test_phi3_longrope_keeps_its_attention_and_says_why(tmp_path):
    rope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    metrics, graph = _export(tmp_path, "phi3", rope_scaling=rope, original_max_position_embeddings=64)
    assert metrics["attention"]["op"] is None and "'longrope'" in metrics["attention"]["why"]
    assert not _gqa_nodes(graph) and metrics["spec"]["cache"] == "concat"


def test_smollm3_no_rope_layer_takes_no_rotary_and_granite_its_attention_multiplier(tmp_path):
    metrics, graph = _export(tmp_path, "smollm3")  # no_rope_layers [1, 0]: the second layer has none
    assert [(_attributes(n)["do_rotary"], len(n.input)) for n in _gqa_nodes(graph)] == [(1, 9), (0, 7)]
    assert metrics["probe_max_abs_diff"] < 1e-4
    metrics, graph = _export(tmp_path / "granite", "granite")  # logits divided by logits_scaling after the head
    assert {_attributes(n)["scale"] for n in _gqa_nodes(graph)} == {0.3}
    assert metrics["last_token_logits"] and metrics["probe_max_abs_diff"] < 1e-4
