"""Planning: what is written and read, by whom. Pure functions over plain data."""
