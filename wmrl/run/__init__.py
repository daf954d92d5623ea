"""Composition roots: one Hydra entry point per ``wmrl`` subcommand. Only these modules read
config; they build objects (``hydra.utils.instantiate``) and pass them down."""
