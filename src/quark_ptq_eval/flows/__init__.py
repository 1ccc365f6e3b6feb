"""The flows: the recipe end to end (pipeline), compare, the CLI, the Python API and the demo."""
