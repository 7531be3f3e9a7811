"""What a target file's keys may hold: the allowed values (CHOICES) and the numeric ranges (RANGES) that
`target_from_toml` checks as it parses, the one place they are checked."""

from __future__ import annotations

DEVICES = ("cpu", "gpu")
ENGINES = ("onnxruntime", "openvino", "tensorrt")
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "auto")
KERNEL_CLASSES = ("amx", "avx512-vnni", "avx512", "avx2", "any")
CANDIDATE_ENGINES = ("onnxruntime", "openvino")
CANDIDATE_PRECISIONS = ("fp32", "bf16", "int8", "int4")
CANDIDATE_QUANTIZE = ("none", "dynamic", "static", "nncf", "weight_only")
FAMILIES = ("encoder", "decoder", "speech", "text2text")
# The target `native` resolves to, by the build host's kernel class (pipeline.runtime.host.kernel_class).
QUANT_MODES = ("none", "dynamic", "static", "weight_only")
QUANT_TYPES = ("int8", "uint8")
QUANT_FORMATS = ("qoperator", "qdq")
WEIGHT_BLOCKS = ("symmetric", "zero_point", "minimum")
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
GRAPH_LEVELS = ("disabled", "basic", "extended", "all")
EXECUTION_MODES = ("sequential", "parallel")
OVERLONG = ("truncate", "refuse")
HARDWARE_COMPATIBILITY = ("none", "ampere_plus", "same_compute_capability")

# (section, key) -> the values allowed. Checked where targets are parsed, nowhere else.
CHOICES = {
    ("device",): DEVICES,
    ("kernel_class",): KERNEL_CLASSES,
    ("candidates", "engine"): CANDIDATE_ENGINES,
    ("candidates", "precision"): CANDIDATE_PRECISIONS,
    ("candidates", "quantize"): CANDIDATE_QUANTIZE,
    ("candidates", "family"): FAMILIES,
    ("candidates", "bits"): (4, 8),
    ("candidates", "blocks"): WEIGHT_BLOCKS,
    ("candidates", "block_size"): (16, 32, 64, 128, 256),
    ("candidates", "bisect_layers"): ("none", "leading", "trailing"),
    ("quantize", "blocks"): WEIGHT_BLOCKS,
    ("engine",): ENGINES,
    ("precision",): PRECISIONS,
    ("quantize", "mode"): QUANT_MODES,
    ("quantize", "bits"): (4, 8),
    ("quantize", "head_bits"): (4, 8),
    ("quantize", "block_size"): (16, 32, 64, 128, 256),
    ("quantize", "accuracy_level"): (0, 1, 2, 3, 4),
    ("quantize", "weight_type"): QUANT_TYPES,
    ("quantize", "activation_type"): QUANT_TYPES,
    ("quantize", "format"): QUANT_FORMATS,
    ("quantize", "calibration_method"): CALIBRATION_METHODS,
    ("shapes", "overlong"): OVERLONG,
    ("tensorrt", "hardware_compatibility"): HARDWARE_COMPATIBILITY,
    ("optimize", "level"): (0, 1, 2, 99),  # ONNX Runtime's transformer optimizer takes these opt_levels only
    ("runtime", "graph_optimization_level"): GRAPH_LEVELS,
    ("runtime", "execution_mode"): EXECUTION_MODES,
    ("runtime", "candidate_execution_modes"): EXECUTION_MODES,
}


# (section, key) -> (lowest, highest); None leaves that side open. Checked where targets are parsed, nowhere else.
RANGES = {
    ("quantize", "smooth_alpha"): (0.0, 1.0),
    ("quantize", "smooth_alphas"): (0.0, 1.0),
    ("quantize", "percentile"): (50.0, 100.0),
    ("quantize", "range_margin"): (1.0, 4.0),
    ("quantize", "calibration_batch_size"): (1, None),
    ("quantize", "max_fp32_nodes"): (0, None),
    ("quantize", "fallback_headroom"): (0.0, 0.99),
    ("quantize", "calibration_examples"): (1, None),
    ("shapes", "max_sequence_length"): (0, None),
    ("shapes", "batch_size"): (1, 4096),
    ("runtime", "intra_op_threads"): (0, 1024),
    ("runtime", "inter_op_threads"): (0, 1024),
    ("runtime", "candidate_threads"): (1, 1024),
    ("accuracy", "cosine_min"): (0.0, 1.0),
    ("accuracy", "cosine_mean"): (0.0, 1.0),
    ("accuracy", "top10_agreement"): (0.0, 1.0),
    ("accuracy", "top1_agreement"): (0.0, 1.0),
    ("accuracy", "max_probability_diff"): (0.0, 1.0),
    ("accuracy", "max_abs_diff"): (0.0, None),
    ("accuracy", "greedy_match"): (0.0, 1.0),
    ("accuracy", "teacher_top1_agreement"): (0.0, 1.0),
    ("accuracy", "perplexity_ratio"): (1.0, None),
    ("accuracy", "word_error_rate"): (0.0, 1.0),
    ("accuracy", "greedy_prefix_agreement"): (0.0, 1.0),
    ("generation", "new_tokens"): (1, None),
    ("generation", "prompts"): (1, None),
    ("generation", "speed_batch_sizes"): (1, 4096),
    ("generation", "speed_new_tokens"): (2, None),
    ("tensorrt", "min_batch"): (1, None),
    ("tensorrt", "opt_batch"): (1, None),
    ("tensorrt", "max_batch"): (1, None),
    ("tensorrt", "min_sequence"): (1, None),
    ("tensorrt", "opt_sequence"): (1, None),
    ("tensorrt", "max_sequence"): (0, None),
    ("tensorrt", "workspace_mb"): (1, None),
    ("tensorrt", "builder_optimization_level"): (0, 5),
    ("serving", "max_batch_size"): (0, 4096),
    ("serving", "preferred_batch_sizes"): (1, 4096),
    ("serving", "max_queue_delay_us"): (0, 10_000_000),
    ("serving", "instances"): (1, 64),
}
