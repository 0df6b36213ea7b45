"""DeepSpeed ZeRO checkpoints (stages 1-3, and universal checkpoints) read, converted and expanded without
DeepSpeed (``zero`` is the entry point; ``objects`` reads and writes DeepSpeed's pickled objects as data)."""
