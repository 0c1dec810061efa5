"""ONNX Runtime beside the passes: verification, A/B benchmarks, fp16 copies, ORT's transformers optimizer."""
