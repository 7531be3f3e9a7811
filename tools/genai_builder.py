"""onnxruntime-genai's model builder, run as `make genai-models` runs it (in .venv-genai), with Gemma 3's RoPE
settings put where onnxruntime-genai 0.18 reads them.

Its Gemma 3 builder reads `rope_theta` and `rope_local_base_freq`, transformers 4's config attributes, and a flat
`rope_parameters`. transformers 5.25, which the builder needs for every other family, keeps both thetas in
`rope_parameters` by layer type, so the builder stops (KeyError 'rope_type'), and without the attributes it would
build the global layers' rotary cache at theta 10,000 instead of 1,000,000. This sets the two attributes from the
nested table, and `rope_parameters` to the full-attention layers' own, as its Gemma 4 path does; every other
config is passed on unchanged.

    .venv-genai/bin/python tools/genai_builder.py -i MODEL -o OUT -p fp32 -e cpu
"""

import runpy

import transformers

_load = transformers.AutoConfig.from_pretrained


def _config_for_the_builder(*args, **kwargs):
    config = _load(*args, **kwargs)
    rope = getattr(config, "rope_parameters", None)
    if getattr(config, "model_type", "") == "gemma3_text" and isinstance(rope, dict) and "full_attention" in rope:
        config.rope_theta = rope["full_attention"]["rope_theta"]
        config.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
        config.rope_parameters = dict(rope["full_attention"])
    return config


if __name__ == "__main__":
    transformers.AutoConfig.from_pretrained = _config_for_the_builder
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
