"""Tiny random text-to-text checkpoints (T5, BART, Marian, M2M100) with a byte-level BPE tokenizer, for the tests.

Their weights are drawn wider than the families' defaults (init_std, T5's initializer_factor), so that a random
model's output depends on its input rather than repeating one token whatever it reads."""

from __future__ import annotations

from pathlib import Path

from tests.tiny import decoder_tokenizer

_SMALL = {
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 128,
    "init_std": 0.3,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_T5 = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "feed_forward_proj": "gated-gelu"}
# model_type -> (config class, model class, source template, settings)
FAMILIES = {
    "bart": ("BartConfig", "BartForConditionalGeneration", "<s> $A </s>", {"decoder_start_token_id": 2}),
    "marian": ("MarianConfig", "MarianMTModel", "$A </s>", {"decoder_start_token_id": 0}),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", "$A </s>", {"decoder_start_token_id": 2}),
    "m2m_100": ("M2M100Config", "M2M100ForConditionalGeneration", "$A </s>", {"decoder_start_token_id": 2}),
    "t5": ("T5Config", "T5ForConditionalGeneration", "$A </s>", _T5),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", "$A </s>", _T5),
}


def make_text2text(folder: Path, model_type: str = "bart", seed: int = 0) -> Path:
    """Save a tiny random text-to-text model of `model_type` (a FAMILIES row) with its tokenizer into `folder`."""
    import torch
    import transformers
    from tokenizers import processors

    config_class, model_class, template, settings = FAMILIES[model_type]
    tokenizer = decoder_tokenizer(["<pad>", "<s>", "</s>", "<unk>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<s>", 1), ("</s>", 2)] if "<s>" in template else [("</s>", 2)]
    )
    if model_type in ("t5", "mt5"):
        config = {**settings, "initializer_factor": 8.0, "decoder_start_token_id": 0, "pad_token_id": 0}
        config["eos_token_id"] = 2
    else:
        config = {**_SMALL, **settings}
    config = getattr(transformers, config_class)(vocab_size=tokenizer.get_vocab_size(), **config)
    torch.manual_seed(seed)
    getattr(transformers, model_class)(config).eval().save_pretrained(folder)
    special = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special).save_pretrained(folder)
    return folder
