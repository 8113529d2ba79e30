"""The flags; no torch, so --help is instant."""
