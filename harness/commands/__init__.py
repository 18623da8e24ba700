"""Subcommands: each module has add_arguments(parser) and main(args)."""
