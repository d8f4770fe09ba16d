"""This repository's tests: a regular package, so that `import tests` is this directory even where
another distribution installs a top-level `tests` package (verl's wheel does): the repository root
comes first on `sys.path` (pytest's `pythonpath = ["."]`), and a regular package there wins over
anything later."""
