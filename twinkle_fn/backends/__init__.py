"""Backends: how a `Model` runs forward/backward (one module per backend)."""
