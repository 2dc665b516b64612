"""phoenixrun: fault-tolerant launcher for PyTorch training (PHOENIX hot-swap)."""
