"""The artifact's file names, declared once: the writer (pipeline.build.stages.publish) and the reader
(pipeline.runtime.artifact, load) and everything between them name files through these.

    artifacts/<model>/v<N>/<target>/
      model.onnx | model.xml + model.bin   the graph (ONNX Runtime, TensorRT | OpenVINO), [<graph>.data] beside it
      model.int8.onnx                      a TensorRT target's int8 Q/DQ graph, beside its fp16 model.onnx
      encoder.onnx + decoder.onnx          a speech or text-to-text model's two graphs, in place of model.onnx
      tokenizer.json | preprocessor_config.json   what turns input into the graph's tensors (text | pictures)
      text.onnx + tokenizer.json           a two-tower model's text tower, beside its image tower and processor
      report.json                          the build's timings and stage metrics (hashed, not the identity)
      manifest.json                        names and hashes every file above; the loader verifies it first
"""

MANIFEST = "manifest.json"
REPORT = "report.json"
TOKENIZER = "tokenizer.json"
IMAGE_PROCESSOR = "preprocessor_config.json"  # an image model's, in place of a tokenizer
GRAPH = "model.onnx"  # the graph an artifact runs on ONNX Runtime or TensorRT
INT8_GRAPH = "model.int8.onnx"
OPENVINO_GRAPH = "model.xml"
OPENVINO_WEIGHTS = "model.bin"
DATA_SUFFIX = ".data"  # a graph's weights that did not fit in it: `<graph name>.data`, beside it
ENCODER_GRAPH = "encoder.onnx"  # a speech or text-to-text encoder (it also computes the cross-attention cache)
TEXT_GRAPH = "text.onnx"  # a two-tower image-text model's text tower, beside its image tower (model.onnx)
DECODER_GRAPH = "decoder.onnx"  # its text decoder, one step with its self-attention cache
