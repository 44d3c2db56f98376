"""A shared topology for the fault matrix (two instances of each tier)."""
