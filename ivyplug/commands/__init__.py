"""Subcommands of the ``ivyplug`` console script, one module each."""
