"""DeepSpeed ZeRO checkpoints."""
