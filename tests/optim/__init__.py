"""The optimizers: against torch.optim, their API, torch's generic optimizer tests, capturable, rounding, 4 bits."""
