"""The file format: safetensors reader/writer, compression, the torch.save stream, the golden files."""
