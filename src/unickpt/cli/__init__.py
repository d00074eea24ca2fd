"""The ``unickpt`` command line."""
