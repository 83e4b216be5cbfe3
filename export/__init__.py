"""csa2onnx's compiler side: configuration, layer plan, model export, runtime and CLI."""
