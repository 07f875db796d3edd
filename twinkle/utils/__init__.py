"""Upstream Twinkle's utilities that its scripts import (`twinkle.utils.framework.Torch`)."""
