"""Optimizers: AdamW parameter grouping (and, later, Muon, Muon+, cautious and hybrid routing)."""
