"""Files a user gives and files the harness writes: a spec's YAML read strictly and bounded
(yaml_reader), outputs written whole or not at all and never over a special file (atomic), one
writer at a time (lock)."""
