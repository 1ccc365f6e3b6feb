"""The `quark-ptq-eval` command line, above the flows: ``main.py`` builds the parser from the one table of
commands (``commands/__init__.py``: name, help, module) and runs the one asked for; each command is one
module of ``commands/`` with ``add_arguments(parser)`` and ``run(args) -> int``; the argument groups
several commands share are in ``args.py``. Nothing below this package imports it."""
