"""Text-to-text families: a text encoder and a text decoder (pipeline/build/text2text/), exported through
transformers' own modules with a cache of tensors; the export's probe refuses a checkpoint whose graphs differ
from PyTorch."""

from pipeline.build.inputs.architectures import Architecture

TEXT2TEXT = tuple(
    Architecture(model_type, "text2text") for model_type in ("t5", "mt5", "bart", "mbart", "marian", "m2m_100")
)
