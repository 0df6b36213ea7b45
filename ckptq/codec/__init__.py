"""What is stored how: the operations and their kernels' dispatch (``ops``), codebooks, the quantized
state type (``qstate``), the one planner of what goes low-bit (``plan``), DTensor placement (``sharded``),
other optimizers' 8-bit state (``foreign``), and checkpoint trees <-> skeleton + stored tensors (``tree``,
``skeleton``)."""
