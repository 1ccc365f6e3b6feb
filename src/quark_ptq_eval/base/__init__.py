"""The base layer: artifacts, state, gates, files, options, ui, errors and contracts. Imports nothing above it."""
