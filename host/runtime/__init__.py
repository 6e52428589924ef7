"""The runtime: sessions, the executor, tensors, graph-capture orchestration, the ONNX backend."""
