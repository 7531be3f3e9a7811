"""gqa_from_decomposed: a graph pass that replaces the decomposed attention of a decoder export with ONNX Runtime's
GroupQueryAttention contrib op: Llama-like layers (Llama, Mistral, Qwen2/3, Phi-3, Gemma 1-3, Granite, OLMo2,
SmolLM3) with rotary embedding inside and Q/K/V packed into one MatMul, or, where queries and keys go through an
RMSNorm first (Qwen3, Gemma 3, OLMo2), fed to the op as separate query, key and value after the norms;
GPT-2 (Q/K/V already packed by c_attn, learned positions) with kv_num_heads = num_heads, which is multi-head
attention with the same cache handling; GPT-NeoX (Pythia) likewise, its query_key_value columns reordered from
per-head [q, k, v] to the op's [Q, K, V], with its partial rotary (the first rotary_pct of each head) inside the op.

Per layer, optimum's export computes

    x -> q_proj, k_proj, v_proj -> Reshape/Transpose -> RoPE (Slice, Neg, Concat, Mul, Add)
      -> present = Concat(past, new) -> repeat KV heads (Expand) -> QK^T, mask, Softmax, AV -> o_proj

which becomes

    x -> MatMul(W_qkv) [-> Add(b_qkv)] -> GroupQueryAttention(past, seqlens_k, total, cos, sin) -> o_proj

or, with q/k norms, which stay in the graph as exported:

    x -> q_proj -> [Reshape/Transpose] -> q_norm -> [merge heads] --query--+
    x -> k_proj -> [Reshape/Transpose] -> k_norm -> [merge heads] --key----+-> GroupQueryAttention -> o_proj
    x -> v_proj ------------------------------------------------ --value--+

Per layer the family's record adds the op's `scale` (Gemma's query_pre_attn_scalar, Granite's attention_multiplier),
`softcap` (Gemma 2's attention logit softcapping), `local_window_size` (sliding-window layers) and which rotary
cache the layer reads (Gemma 3's local layers have their own base frequency; SmolLM3's no-rope layers none).

The graph takes right-padded batches, as onnxruntime-genai's do: `seqlens_k` is each row's own length less one
(the mask's row sum), so the op writes and reads each row's cache at that row's own end, masks what lies beyond,
and rotates each token at its true position; a padded row computes exactly as it would alone. The export's
last-position Slice becomes a per-row gather. The graph's `position_ids` input is dropped.

The op reads past_key/past_value in BNSH and, when the caller binds present to the same buffer as past (sized to
the longest sequence), appends the new tokens in place: no per-step copy of the cache.
"""

from __future__ import annotations

import numpy as np

from pipeline.build.onnx_files import with_opset

# ONNX Runtime's CPU kernel refuses rotary embedding inside GroupQueryAttention over other widths (its cos cache
# must be a multiple of 8 wide, half the rotated dimensions).
ROTARY_MULTIPLE = 16


def gpt2_problem(model) -> str | None:
    """Why a GPT-2 checkpoint's attention cannot become GroupQueryAttention, or None when it can."""
    config = model.config
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) or not getattr(config, "scale_attn_weights", 1):
        return "GPT-2 attention scaled other than by 1/sqrt(head size) is not rewritten"
    return None


def body(model):
    """The decoder stack under the LM head (its layers, norms and rotary modules). Gemma3ForCausalLM names its
    base model prefix `language_model` but keeps the stack in `model`, so `base_model` is the head itself."""
    base = model.base_model
    return getattr(model, "model", base) if base is model else base


# Rotary types whose frequencies depend on the sequence's length: one cos/sin cache cannot hold them.
LENGTH_DEPENDENT_ROTARY = ("dynamic", "longrope")


def rotary_problem(model) -> str | None:
    """Why a rotary-embedding checkpoint's attention cannot take its rotary inside GroupQueryAttention, or None."""
    modules = {n: m for n, m in body(model).named_children() if n.startswith("rotary_emb")}
    if "rotary_emb" not in modules:
        return "the model has no rotary_emb module to build the cos/sin cache from"
    for name, rotary in modules.items():
        kind = getattr(rotary, "rope_type", "default")
        if kind in LENGTH_DEPENDENT_ROTARY:
            return (
                f"its {name} ({kind!r} rope scaling) changes frequencies with the sequence length, which one "
                "cos/sin cache inside the op cannot follow"
            )
        dims = 2 * len(rotary.inv_freq)
        if dims % ROTARY_MULTIPLE:
            return f"{dims} rotary dimensions a head is not a multiple of {ROTARY_MULTIPLE}, which the CPU kernel needs"
    return None


def rotary_cache(model, length: int, module: str = "rotary_emb") -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [length, rotary dimensions / 2] of the model's own rotary embedding `module` (its scaling type
    and factor included) at positions 0 .. length - 1."""
    import torch

    positions = torch.arange(length)[None]
    probe = torch.zeros(1, dtype=torch.float32)
    with torch.inference_mode():
        cos, sin = getattr(body(model), module)(probe, positions)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy().astype(np.float32), sin[0, :, :half].numpy().astype(np.float32)


def _projection(nodes: dict, weights: dict, prefix: str, name: str) -> tuple:
    """(input, weight array, bias array or None) of one linear projection of an attention block."""
    matmul = nodes.get(f"{prefix}{name}/MatMul")
    if matmul is None or matmul.input[1] not in weights:
        raise LookupError(f"{prefix}{name}/MatMul with a constant weight")
    add = nodes.get(f"{prefix}{name}/Add")
    bias = None
    if add is not None:
        bias_name = next((i for i in add.input if i in weights), None)
        if bias_name is None:
            raise LookupError(f"{prefix}{name}/Add with a constant bias")
        bias = weights[bias_name]
    return matmul.input[0], weights[matmul.input[1]], bias


def _mask_nodes(helper, tensor) -> list:
    """Nodes that turn a right-padded attention_mask [b, total] into each row's seqlens_k (its real tokens, less
    one) and total_sequence_length: the op reads and writes each row's cache at that row's own length, and
    rotates each token by its own position, so padding needs no bias and a row computes as it would alone."""
    const = {"gqa/one": np.array(1, np.int64), "gqa/axes_1": np.array([1], np.int64)}
    nodes = [helper.make_node("Constant", [], [k], value=tensor.from_array(v, k)) for k, v in const.items()]
    make = helper.make_node
    nodes += [
        make("ReduceSum", ["attention_mask", "gqa/axes_1"], ["gqa/lengths"], keepdims=0),
        make("Sub", ["gqa/lengths", "gqa/one"], ["gqa/seqlens_i64"]),
        make("Cast", ["gqa/seqlens_i64"], ["gqa/seqlens_k"], to=6),  # int32
        make("Shape", ["attention_mask"], ["gqa/mask_shape"]),
        make("Gather", ["gqa/mask_shape", "gqa/one"], ["gqa/total_i64"], axis=0),
        make("Cast", ["gqa/total_i64"], ["gqa/total"], to=6),
    ]
    return nodes


def _last_real_position(g, helper, tensor) -> None:
    """Replace the export's last-position Slice (see `last_token_logits`) by a per-row gather: in a right-padded
    batch each row's last real token is at its own place (seqlens_k - (total - new tokens) on the prompt, 0 on a
    later one-token step)."""
    sliced = next((n for n in g.node if n.name == "last_token_slice"), None)
    if sliced is None:
        return
    const = {
        "gqa/zero": np.array(0, np.int64),
        "gqa/axes_12": np.array([1, 2], np.int64),
        "gqa/one_1d": np.array([1], np.int64),
        "gqa/two_1d": np.array([2], np.int64),
        "gqa/three_1d": np.array([3], np.int64),
        "gqa/zero_1d": np.array([0], np.int64),
    }
    make = helper.make_node
    hidden = sliced.input[0]
    nodes = [make("Constant", [], [k], value=tensor.from_array(v, k)) for k, v in const.items()]
    nodes += [
        make("Shape", ["input_ids"], ["gqa/ids_shape"]),
        make("Gather", ["gqa/ids_shape", "gqa/one"], ["gqa/new"], axis=0),
        make("Sub", ["gqa/total_i64", "gqa/new"], ["gqa/past"]),
        make("Sub", ["gqa/seqlens_i64", "gqa/past"], ["gqa/last_raw"]),
        make("Max", ["gqa/last_raw", "gqa/zero"], ["gqa/last"]),
        make("Unsqueeze", ["gqa/last", "gqa/axes_12"], ["gqa/last_3d"]),
        make("Shape", [hidden], ["gqa/hidden_shape"]),
        make("Slice", ["gqa/hidden_shape", "gqa/zero_1d", "gqa/one_1d"], ["gqa/batch"]),
        make("Slice", ["gqa/hidden_shape", "gqa/two_1d", "gqa/three_1d"], ["gqa/width"]),
        make("Concat", ["gqa/batch", "gqa/one_1d", "gqa/width"], ["gqa/gather_shape"], axis=0),
        make("Expand", ["gqa/last_3d", "gqa/gather_shape"], ["gqa/gather_index"]),
        make("GatherElements", [hidden, "gqa/gather_index"], [sliced.output[0]], axis=1, name="last_token_gather"),
    ]
    at = list(g.node).index(sliced)
    g.node.remove(sliced)
    for offset, node in enumerate(nodes):
        g.node.insert(at + offset, node)


def _prune(graph) -> None:
    """Drop nodes whose outputs nothing needs, then unused initializers and inputs."""
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
            for attr in node.attribute:  # subgraph inputs (If, Loop) count as needed
                for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    needed.update(i for n in sub.node for i in n.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    for field in (graph.initializer, graph.input):
        alive = [item for item in field if item.name in needed]
        del field[:]
        field.extend(alive)


def _packed_projection(prefix: str, x: str, weight: np.ndarray, bias, arrays: dict) -> tuple[list, str]:
    """One MatMul (and bias Add) of `x` by a packed [Q, K, V] weight, its arrays put in `arrays`: (nodes, output)."""
    from onnx import helper

    name = f"{prefix}qkv_proj"
    arrays[f"{name}.weight"] = weight
    made = [helper.make_node("MatMul", [x, f"{name}.weight"], [f"{name}/out"], name=f"{name}/MatMul")]
    if bias is None:
        return made, f"{name}/out"
    arrays[f"{name}.bias"] = bias
    made.append(helper.make_node("Add", [f"{name}/out", f"{name}.bias"], [f"{name}/biased"], name=f"{name}/Add"))
    return made, f"{name}/biased"


def _output(nodes: dict, prefix: str, name: str) -> str:
    """The output of a projection: its bias Add where it has one, else its MatMul."""
    add = nodes.get(f"{prefix}{name}/Add")
    return (add or nodes[f"{prefix}{name}/MatMul"]).output[0]


def _normed(g, prefix: str, scope: str, arrays: dict) -> tuple[list, str]:
    """The output of the norm module `scope` (q_norm, k_norm) as [b, s, heads * head size]: (nodes, output). A
    per-head norm reads [b, s, heads, d] (after the view) or [b, heads, s, d] (after the transpose too); its heads
    are merged back here. A full-width norm (OLMo2) reads the projection itself and needs nothing."""
    from onnx import helper

    inside = [n for n in g.node if n.name.startswith(f"{prefix}{scope}/")]
    made_inside = {o for n in inside for o in n.output}
    outside = [n for n in g.node if not n.name.startswith(f"{prefix}{scope}/")]
    read_outside = {i for n in outside for i in n.input}
    ends = [o for n in inside for o in n.output if o in read_outside]
    producers = {o: n for n in g.node for o in n.output}
    constants = {i.name for i in g.initializer}
    starts = {i for n in inside for i in n.input if i and i not in made_inside and i not in constants}
    # Constants, and initializers the exporter shares through Identity (equal norm weights of a random model).
    fixed = {
        n.output[0] for n in g.node if n.op_type == "Constant" or (n.op_type == "Identity" and n.input[0] in constants)
    }
    starts = {i for i in starts if i in producers and i not in fixed}
    if len(ends) != 1 or len(starts) != 1:
        raise LookupError(f"{prefix}{scope} with one input and one output")
    before = producers[starts.pop()].op_type
    if before not in ("Transpose", "Reshape"):
        return [], ends[0]
    arrays["gqa/merge_heads"] = np.array([0, 0, -1], np.int64)
    made, x = [], ends[0]
    if before == "Transpose":  # [b, heads, s, d] -> [b, s, heads, d]
        made.append(helper.make_node("Transpose", [x], [f"{prefix}gqa/{scope}_bshd"], perm=[0, 2, 1, 3]))
        x = made[-1].output[0]
    made.append(helper.make_node("Reshape", [x, "gqa/merge_heads"], [f"{prefix}gqa/{scope}_merged"]))
    return made, made[-1].output[0]


def _llama_layer(g, nodes: dict, weights: dict, layer: int, heads: int) -> dict:
    """Where a Llama-like layer's attention starts and ends: its q/k/v projections (packed here into one MatMul,
    with their biases where they have them; Phi-3's qkv_proj is packed already), or, with q/k norms, the norms'
    outputs and v_proj's; and the o_proj MatMul that reads the attention's output."""
    from onnx import numpy_helper

    prefix = f"/model/layers.{layer}/self_attn/"
    o_proj = nodes.get(f"{prefix}o_proj/MatMul")
    if o_proj is None:
        raise LookupError(f"{prefix}o_proj/MatMul")
    plan = {"prefix": prefix, "readers": [o_proj], "replaces": o_proj.input[0]}
    if f"{prefix}qkv_proj/MatMul" in nodes:  # already [Q, K, V], the op's packed order
        _projection(nodes, weights, prefix, "qkv_proj")
        return plan | {"build": lambda arrays: ([], [_output(nodes, prefix, "qkv_proj"), "", ""])}
    parts = [_projection(nodes, weights, prefix, f"{p}_proj") for p in "qkv"]
    if len({p[0] for p in parts}) != 1:
        raise LookupError(f"layer {layer}: one input shared by q, k and v projections")
    if any(n.startswith(f"{prefix}q_norm/") for n in nodes):

        def separate(arrays: dict) -> tuple[list, list]:
            query_nodes, query = _normed(g, prefix, "q_norm", arrays)
            key_nodes, key = _normed(g, prefix, "k_norm", arrays)
            return query_nodes + key_nodes, [query, key, _output(nodes, prefix, "v_proj")]

        return plan | {"build": separate}
    if len({b is None for _, _, b in parts}) != 1:
        raise LookupError(f"layer {layer}: a bias on all of q, k and v or on none")

    def build(arrays: dict) -> tuple[list, list]:
        loaded = [(numpy_helper.to_array(w), None if b is None else numpy_helper.to_array(b)) for _, w, b in parts]
        weight = np.concatenate([w for w, _ in loaded], axis=1)
        bias = None if loaded[0][1] is None else np.concatenate([b for _, b in loaded])
        made, packed = _packed_projection(prefix, parts[0][0], weight, bias, arrays)
        return made, [packed, "", ""]

    return plan | {"build": build}


def _neox_layer(g, nodes: dict, weights: dict, layer: int, heads: int) -> dict:
    """Where a GPT-NeoX layer's attention starts and ends: query_key_value, whose output columns hold each head's
    q, k and v side by side ([heads, 3, head size]), reordered into the op's [3, heads, head size]; and the dense
    MatMul that reads the attention's output."""
    from onnx import numpy_helper

    prefix = f"/gpt_neox/layers.{layer}/attention/"
    x, weight, bias = _projection(nodes, weights, prefix, "query_key_value")
    dense = nodes.get(f"{prefix}dense/MatMul")
    if dense is None:
        raise LookupError(f"{prefix}dense/MatMul")

    def by_kind(array: np.ndarray) -> np.ndarray:  # [..., heads * 3 * d] -> [..., 3 * heads * d]
        lead = array.shape[:-1]
        return array.reshape(*lead, heads, 3, -1).swapaxes(-3, -2).reshape(*lead, -1)

    def build(arrays: dict) -> tuple[list, str]:
        packed_bias = None if bias is None else by_kind(numpy_helper.to_array(bias))
        made, packed = _packed_projection(prefix, x, by_kind(numpy_helper.to_array(weight)), packed_bias, arrays)
        return made, [packed, "", ""]

    return {"prefix": prefix, "build": build, "readers": [dense], "replaces": dense.input[0]}


def _gpt2_layer(g, nodes: dict, weights: dict, layer: int, heads: int) -> dict:
    """Where a GPT-2 layer's attention starts and ends: c_attn's output, already Q, K and V packed [b, s, 3h] in the
    order the op takes, and the merged heads c_proj reads."""
    prefix = f"/transformer/h.{layer}/attn/"
    packed, merged = nodes.get(f"{prefix}c_attn/Reshape_1"), nodes.get(f"{prefix}Reshape_3")
    if packed is None or merged is None:
        raise LookupError(f"layer {layer}: {prefix}c_attn/Reshape_1 and {prefix}Reshape_3")
    readers = [n for n in g.node if merged.output[0] in n.input]
    return {
        "prefix": prefix,
        "build": lambda arrays: ([], [packed.output[0], "", ""]),
        "readers": readers,
        "replaces": merged.output[0],
    }


LAYOUTS = {"llama": _llama_layer, "gpt2": _gpt2_layer, "neox": _neox_layer}


def gqa_from_decomposed(graph, layout: str, layers: int, heads: int, kv_heads: int, rotary=None, options=None) -> dict:
    """Rewrite `graph` (an optimum export whose layers follow `layout`, a LAYOUTS key; ModelProto) in place; returns
    node counts before and after. `rotary` maps a cache name to its (cos, sin) for rotary embedding inside the op
    (none for GPT-2, whose positions are learned and added before the first layer). `options` holds, per layer, the
    op's extra attributes (scale, softcap, local_window_size) and under "rotary" the name of the layer's cache
    (default "rotary_emb"; None: the layer has no rotary). Raises LookupError, changing nothing, when a layer's
    attention is not where the export puts it."""
    from onnx import helper, numpy_helper

    g = graph.graph
    before = len(g.node)
    nodes = {n.name: n for n in g.node}
    weights = {i.name: i for i in g.initializer}
    # The exporter shares equal initializers (zero biases of a random model) through Identity nodes.
    weights |= {n.output[0]: weights[n.input[0]] for n in g.node if n.op_type == "Identity" and n.input[0] in weights}
    plans = [LAYOUTS[layout](g, nodes, weights, layer, heads) for layer in range(layers)]
    rotary = rotary or {}
    options = options or [{} for _ in range(layers)]
    arrays = {f"gqa/{name}/{part}": cache[i] for name, cache in rotary.items() for i, part in enumerate(("cos", "sin"))}
    built = [plan["build"](arrays) for plan in plans]  # reads the graph: before any node is removed
    for layer, (plan, (made, qkv)) in enumerate(zip(plans, built, strict=True)):
        attributes = {k: v for k, v in options[layer].items() if k != "rotary"}
        cache = options[layer].get("rotary", "rotary_emb") if rotary else None
        if cache is not None and cache not in rotary:
            raise LookupError(f"a rotary cache named {cache} for layer {layer}")
        caches = [f"gqa/{cache}/cos", f"gqa/{cache}/sin"] if cache else []
        past = [f"past_key_values.{layer}.{kv}" for kv in ("key", "value")]
        present = [f"present.{layer}.{kv}" for kv in ("key", "value")]
        for node in [n for n in g.node if set(n.output) & set(present)]:
            g.node.remove(node)
        out = f"{plan['prefix']}gqa/out"
        made.append(
            helper.make_node(
                "GroupQueryAttention",
                [*qkv, *past, "gqa/seqlens_k", "gqa/total", *caches],
                [out, *present],
                name=f"{plan['prefix']}GroupQueryAttention",
                domain="com.microsoft",
                num_heads=heads,
                kv_num_heads=kv_heads,
                do_rotary=int(cache is not None),
                **attributes,
            )
        )
        # Contrib ops have no ONNX type inference: declare the output's type, or type-driven passes (the fp16
        # conversion of GPU targets) take them for another type than the op's inputs.
        g.value_info.append(helper.make_tensor_value_info(out, 1, None))  # present.* are typed graph outputs
        for reader in plan["readers"]:
            reader.input[:] = [out if i == plan["replaces"] else i for i in reader.input]
        at = min(list(g.node).index(reader) for reader in plan["readers"])
        for offset, node in enumerate(made):
            g.node.insert(at + offset, node)
    g.initializer.extend(numpy_helper.from_array(a, n) for n, a in arrays.items())
    for offset, node in enumerate(_mask_nodes(helper, numpy_helper)):
        g.node.insert(offset, node)
    _last_real_position(g, helper, numpy_helper)
    with_opset(graph, "com.microsoft")
    _prune(g)
    return {"op": "GroupQueryAttention", "layers": layers, "nodes_before": before, "nodes_after": len(g.node)}
