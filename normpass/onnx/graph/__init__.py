"""Reading an ONNX model into the zero-mean graph, and finishing a rewritten one for writing."""
