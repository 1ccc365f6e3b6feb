"""Doc generators: matrices run for real and the pages they write (python -m bench.docgen.<name>)."""
