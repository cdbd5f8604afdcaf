"""onnx_training_ops: run ai.onnx.preview.training graphs in stock onnxruntime."""
