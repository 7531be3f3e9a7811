"""The machinery behind the search and quantize stages, which are its cached callers.

candidates.py   the candidate table both searches share: build, score and screen each candidate in turn
decoders.py     the decoder search (the encoder search is the search stage itself)
development.py  the calibration examples and the development split they are judged on
int8.py         int8 quantization with smoothing and the accuracy-aware fallback (the quantize stage, ort-int8)
fallback.py     which nodes the fallback keeps in fp32: sensitivity ranking and the bisection
"""
