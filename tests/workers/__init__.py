"""Scripts that torchrun starts, one per rank, run as modules from the checkout root (python -m tests.workers.x)."""
