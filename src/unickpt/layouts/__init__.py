"""How each kind of leaf maps to boxes of a global tensor, and back."""
