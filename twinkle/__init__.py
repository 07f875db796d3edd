"""twinkle: the class API (ModelScope Twinkle's) over the functional core `twinkle_fn`."""

__version__ = "0.1.0"
