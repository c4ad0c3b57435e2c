"""Small shared helpers (torch-free)."""
