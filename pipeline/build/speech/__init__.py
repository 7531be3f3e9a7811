"""Speech-to-text models (Whisper): the export of an encoder and a decoder graph, the PyTorch reference and the
search over their candidates. The runtime side is pipeline/runtime/speech.py."""
