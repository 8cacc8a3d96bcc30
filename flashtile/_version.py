# The one place the version lives: the build backend reads it (pyproject.toml,
# [tool.hatch.version]) and flashtile.__version__ re-exports it.
__version__ = "0.2.0"
