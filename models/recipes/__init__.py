"""Training recipes of the reference zoo (one command each, deterministic, CPU minutes)."""
