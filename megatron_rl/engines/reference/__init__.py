"""The reference engine: our own server of SGLang's HTTP subset over a plain PyTorch model."""
