"""Saves: one object passing through its phases (capture, plan, copy, write, commit), run in
the process's save queue, which owns the staging memory."""
