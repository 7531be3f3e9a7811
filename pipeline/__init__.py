"""Export-and-compile pipeline for transformer models: Hugging Face checkpoint in, validated artifact out.

Nothing is imported here, so `import pipeline.runtime` stays free of torch, transformers and onnx.
"""

__version__ = "0.1.0"
