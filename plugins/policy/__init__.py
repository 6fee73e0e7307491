"""The adaptive draft-length policy node (adaptive_k)."""
