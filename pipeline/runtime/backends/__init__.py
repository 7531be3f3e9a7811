"""Engines behind one session interface: `get_inputs()`, `get_outputs()` (objects with `.name`) and
`run(output_names, feeds) -> list of numpy arrays`, as onnxruntime.InferenceSession has them.

    onnxruntime.py   ONNX Runtime (CPU, and CUDA/TensorRT providers where onnxruntime-gpu is installed)
    openvino.py      OpenVINO's CPU plugin (the `openvino` extra)
    tensorrt.py      a TensorRT engine from the artifact's engine cache (the `tensorrt` extra)

Each imports its engine lazily, so a process loads only the one it runs.
"""
