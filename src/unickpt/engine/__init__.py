"""The I/O engine: staging, the pipelined write and read, async futures."""
