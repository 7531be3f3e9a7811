"""Tiny random checkpoints, saved with save_pretrained: what the tests build and what `make tiny` writes.

    python -m tests.tiny gpt2 .cache/tiny-gpt2        # then: make build MODEL=.cache/tiny-gpt2

The tiny encoders borrow the real MiniLM tokenizer (so text tokenizes into real word pieces); the tiny decoders
get a byte-level BPE tokenizer of 512 tokens trained here on data/calibration.txt, wrapped in each family's
transformers tokenizer class. All have random weights of a few hundred thousand parameters, so a whole build
takes seconds.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from pipeline.build.stages.checkpoint import default_checkpoint

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
HEADS = {
    "feature-extraction": "AutoModel",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "fill-mask": "AutoModelForMaskedLM",
    "question-answering": "AutoModelForQuestionAnswering",
}
_LAYERS = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
# RoBERTa-style families count positions from the padding index + 1 and take no segment ids.
_ROBERTA = {**_LAYERS, "pad_token_id": 0, "max_position_embeddings": 130, "type_vocab_size": 1}
# Per encoder family: config settings beside the common vocabulary and positions. Special token ids are MiniLM's
# ([PAD] 0, [CLS] 101, [SEP] 102), the tokenizer every tiny encoder borrows.
ENCODERS = {
    "bert": _LAYERS,
    "megatron-bert": _LAYERS,  # no record in the table: a generic one, from optimum-onnx's registry
    "roberta": _ROBERTA,
    "xlm-roberta": _ROBERTA,
    "camembert": _ROBERTA,
    "distilbert": {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64, "pad_token_id": 0},
    "electra": {**_LAYERS, "embedding_size": 32},
    "albert": {**_LAYERS, "embedding_size": 16, "pad_token_id": 0, "bos_token_id": 101, "eos_token_id": 102},
    "mpnet": {**_LAYERS, "pad_token_id": 0, "max_position_embeddings": 130},
    "deberta-v2": {
        **_LAYERS,
        "pad_token_id": 0,
        "relative_attention": True,
        "pos_att_type": ["p2c", "c2p"],
        "position_buckets": 16,
        "max_relative_positions": 64,
    },
    "modernbert": {
        **_LAYERS,
        "pad_token_id": 0,
        "bos_token_id": 101,
        "eos_token_id": 102,
        "cls_token_id": 101,
        "sep_token_id": 102,
        "global_attn_every_n_layers": 2,
        "local_attention": 16,
        "reference_compile": False,
    },
}


def tiny_config(model_type: str, task: str):
    """A small random config of the family; classifier heads get three labels."""
    from transformers import AutoConfig

    common = {"vocab_size": 30522, "max_position_embeddings": 128}
    config = AutoConfig.for_model(model_type, **{**common, **ENCODERS[model_type]})
    if task in ("sequence-classification", "token-classification"):
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


# Tiny image encoders: 32x32 pictures in patches of 8, with the processor settings of the family's real checkpoints
# (ViT's and DeiT's resize to the model's size; DINOv2's BiT processor resizes the shortest edge, then crops).
IMAGE_ENCODERS = {
    "vit": ({"patch_size": 8}, {"image_processor_type": "ViTImageProcessor", "size": {"height": 32, "width": 32}}),
    "deit": (
        {"patch_size": 8},
        {
            "image_processor_type": "DeiTImageProcessor",
            "size": {"height": 40, "width": 40},
            "crop_size": {"height": 32, "width": 32},
            "resample": 3,
        },
    ),
    "dinov2": (
        {"patch_size": 8},
        {
            "image_processor_type": "BitImageProcessor",
            "size": {"shortest_edge": 40},
            "crop_size": {"height": 32, "width": 32},
            "do_center_crop": True,
            "resample": 3,
            "image_mean": [0.485, 0.456, 0.406],
            "image_std": [0.229, 0.224, 0.225],
        },
    ),
    # Families built on generic records (the exporter knows them; no table row): a classifier test each.
    "beit": (
        {"patch_size": 8, "use_mask_token": False},
        {
            "image_processor_type": "BeitImageProcessor",
            "size": {"height": 40, "width": 40},
            "crop_size": {"height": 32, "width": 32},
            "do_center_crop": True,
        },
    ),
    "swin": (
        {
            "shape": {
                "image_size": 32,
                "patch_size": 4,
                "embed_dim": 16,
                "depths": [1, 1],
                "num_heads": [1, 2],
                "window_size": 4,
            }
        },
        {"image_processor_type": "ViTImageProcessor", "size": {"height": 32, "width": 32}},
    ),
    "convnext": (
        {"shape": {"image_size": 32, "hidden_sizes": [8, 16], "depths": [1, 1], "num_stages": 2}},
        {"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 32}, "crop_pct": 0.875},
    ),
}
IMAGE_LABELS = {0: "tabby", 1: "rocket", 2: "coffee mug", 3: "astronaut", 4: "motorcycle", 5: "texture"}


def make_image_model(folder: Path, model_type: str = "vit", task: str = "image-feature-extraction", seed: int = 0):
    """Save a tiny random image model of `model_type` for `task` (six labels for a classifier) and its image
    processor's preprocessor_config.json into `folder`."""
    import json

    import torch
    import transformers

    torch.manual_seed(seed)
    model_config, processor = dict(IMAGE_ENCODERS[model_type][0]), IMAGE_ENCODERS[model_type][1]
    shape = {"image_size": 32, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    shape = model_config.pop("shape", {**shape, "intermediate_size": 64})  # a family of other shape keys
    config = transformers.AutoConfig.for_model(model_type, **shape, **model_config)
    if task == "image-classification":
        config.num_labels = len(IMAGE_LABELS)
        config.id2label, config.label2id = IMAGE_LABELS, {v: k for k, v in IMAGE_LABELS.items()}
        # transformers picks among a family's several classifier classes (DeiT's) by the config's architectures.
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES as HEADS

        names = HEADS[model_type]
        config.architectures = [names[0] if isinstance(names, tuple) else names]
        model = transformers.AutoModelForImageClassification.from_config(config)
    else:
        model = transformers.AutoModel.from_config(config)
    model.eval().save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(processor, indent=1))
    return folder


def make_sentence_transformer(
    folder: Path, dense: tuple[tuple[int, str], ...] = ((16, "Tanh"),), normalize: bool = True, seed: int = 0
) -> Path:
    """Save, with sentence-transformers' own classes, a tiny random BERT under mean pooling, then a Dense module of
    each (out_features, torch.nn activation) in `dense`, then Normalize where asked."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    transformer = Transformer(str(make_checkpoint(folder.parent / f"{folder.name}-hf", "bert", seed=seed)))
    width = transformer.get_embedding_dimension()
    modules = [transformer, Pooling(width, "mean")]
    torch.manual_seed(seed + 1)
    for out, activation in dense:
        modules.append(Dense(width, out, activation_function=getattr(torch.nn, activation)()))
        width = out
    SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu").save(str(folder))
    return folder


DECODER_VOCAB = 512
# Per family: the transformers config class, the tokenizer class, its special tokens, and config settings.
_GEMMA = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True}
_LLAMA = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
_ENDOFTEXT = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
_QWEN = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": None, "bos_token": None}
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Sliding windows of 8 tokens, shorter than the tests' prompts plus generation, so that the window changes the output.
DECODERS = {
    # No record in the table: a generic one, from optimum-onnx's registry.
    "opt": (
        "OPTConfig",
        "GPT2TokenizerFast",
        _ENDOFTEXT,
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "ffn_dim": 128,
            "word_embed_proj_dim": 64,
            "max_position_embeddings": 256,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "pad_token_id": 0,
        },
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2TokenizerFast",
        _ENDOFTEXT,
        {
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_inner": 128,
            "n_positions": 256,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
    ),
    "llama": (
        "LlamaConfig",
        "LlamaTokenizerFast",
        _LLAMA,
        {"num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False},
    ),
    "mistral": (
        "MistralConfig",
        "LlamaTokenizerFast",
        _LLAMA,
        {"num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 8},
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2TokenizerFast",
        _QWEN,
        {"num_key_value_heads": 2, "eos_token_id": 0, "tie_word_embeddings": True},
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen2TokenizerFast",
        _QWEN,  # per-head RMSNorm of queries and keys
        {"num_key_value_heads": 2, "head_dim": 16, "eos_token_id": 0, "tie_word_embeddings": True},
    ),
    "phi3": (
        "Phi3Config",
        "LlamaTokenizerFast",
        _LLAMA,  # q, k and v in one qkv_proj
        {"num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
    ),
    "gemma": (
        "GemmaConfig",
        "GemmaTokenizerFast",
        _GEMMA,  # embeddings scaled by sqrt(hidden), RMSNorm (1 + w)
        {"num_key_value_heads": 1, "head_dim": 16, **_IDS},
    ),
    "gemma2": (
        "Gemma2Config",
        "GemmaTokenizerFast",
        _GEMMA,
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
            "layer_types": ["sliding_attention", "full_attention"],
            **_IDS,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "GemmaTokenizerFast",
        _GEMMA,
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            **_IDS,
        },
    ),
    "granite": (
        "GraniteConfig",
        "GPT2TokenizerFast",
        _ENDOFTEXT,
        {
            "num_key_value_heads": 2,
            "attention_multiplier": 0.3,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "logits_scaling": 4.0,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "pad_token_id": 0,
        },
    ),
    "olmo2": (
        "Olmo2Config",
        "GPT2TokenizerFast",
        _ENDOFTEXT,  # RMSNorm over all heads' queries and keys
        {"num_key_value_heads": 2, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0},
    ),
    "smollm3": (
        "SmolLM3Config",
        "GPT2TokenizerFast",
        _ENDOFTEXT,  # the second layer without rotary
        {"num_key_value_heads": 2, "no_rope_layers": [1, 0], "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0},
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXTokenizerFast",
        _ENDOFTEXT,
        {"rotary_pct": 0.5, "bos_token_id": 0, "eos_token_id": 0},
    ),
}
_SPECIALS = {"llama": ["<unk>", "<s>", "</s>"], "qwen2": ["<|endoftext|>"]}
_SPECIALS |= {"gemma": ["<pad>", "<bos>", "<eos>", "<unk>"]}
_SPECIALS |= {
    "mistral": _SPECIALS["llama"],
    "phi3": _SPECIALS["llama"],
    "qwen3": _SPECIALS["qwen2"],
    "gemma2": _SPECIALS["gemma"],
    "gemma3_text": _SPECIALS["gemma"],
}


def decoder_tokenizer(special_tokens: list[str]):
    """A byte-level BPE tokenizer of DECODER_VOCAB tokens trained on the calibration text (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DECODER_VOCAB,
        special_tokens=special_tokens,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator((REPO / "data" / "calibration.txt").read_text().splitlines(), trainer)
    return tokenizer


def make_decoder(folder: Path, model_type: str = "gpt2", seed: int = 0, **config) -> Path:
    """Save a tiny random causal LM of `model_type` (a DECODERS row, its config settings updated with `config`)
    with its tokenizer into `folder`."""
    import torch
    import transformers

    config_class, tokenizer_class, specials, settings = DECODERS[model_type]
    small = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 256,
    }
    made = getattr(transformers, config_class)(**({} if model_type == "gpt2" else small) | settings | config)
    made.vocab_size = DECODER_VOCAB
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(made).eval().save_pretrained(folder)
    tokenizer = getattr(transformers, tokenizer_class)(
        tokenizer_object=decoder_tokenizer(_SPECIALS.get(model_type, ["<|endoftext|>"])), **specials
    )
    tokenizer.save_pretrained(folder)
    return folder


# Random decoders at the layer shapes of real ones (the vocabulary stays DECODER_VOCAB): what a build's memory and
# time are measured on where no such checkpoint can be had offline. llama-1b has TinyLlama-1.1B's layers (0.97B
# parameters here), qwen2-0.5b Qwen2.5-0.5B's (0.36B here: its 136M-parameter vocabulary is left out).
SIZED = {
    "llama-1b": (
        "llama",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 22,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "intermediate_size": 5632,
            "max_position_embeddings": 2048,
        },
    ),
    "qwen2-0.5b": (
        "qwen2",
        {
            "hidden_size": 896,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "intermediate_size": 4864,
            "max_position_embeddings": 2048,
        },
    ),
}


def main(argv: list[str]) -> None:
    """`python -m tests.tiny MODEL_TYPE FOLDER`: save a tiny checkpoint (a decoder family, or an encoder), or a
    random decoder of a real model's size (SIZED)."""
    if len(argv) != 2:
        sys.exit(
            f"usage: python -m tests.tiny MODEL_TYPE FOLDER; decoders: {', '.join(DECODERS)}; encoders: "
            f"{', '.join(ENCODERS)}; sized decoders: {', '.join(SIZED)}"
        )
    model_type, folder = argv
    if model_type in SIZED:
        family, shape = SIZED[model_type]
        make_decoder(Path(folder), family, **shape)
    elif model_type in DECODERS:
        make_decoder(Path(folder), model_type)
    else:
        make_checkpoint(Path(folder), model_type)
    print(f"saved a tiny random {model_type} to {folder}")


if __name__ == "__main__":
    main(sys.argv[1:])
