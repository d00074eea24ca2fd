"""Encoded tensors: tables stored quantized per row, encoded during a save, decoded on load."""
