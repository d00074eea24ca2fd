"""The I/O engine: copies into staging memory, data files written in parts, reads, futures."""
