"""Speech-to-text families: an audio encoder and a text decoder (pipeline/build/speech/)."""

from pipeline.build.inputs.architectures import Architecture

SPEECH = (Architecture("whisper", "speech", modality="audio"),)
