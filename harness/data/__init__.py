"""Tokens: where a run's tokens come from (source.py: seeded uniform or Markov-chain tokens, or a memory-mapped
token file, the same global batch on every rank, then each engine's slice of it) and how a
token file is made from text (prepare.py, `harness data prepare`)."""
