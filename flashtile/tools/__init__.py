"""The kernel engineer's tools behind ``python -m flashtile <command>`` (cli.py lists them).

Nothing here is imported by ``import flashtile``: the tools load only when a command runs.
"""
