"""The package version (a leaf: imported by the package face and by what records the version)."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's [project] version (tests/test_imports.py)
