"""Text-to-text models (T5, BART, mBART, Marian, M2M100/NLLB): export, decoding settings, gate and search."""
