"""Where the tests' own files are, wherever in tests/ a test module sits."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
DATA = TESTS / "data"  # scorers and workers the tests load by path
ROOT = TESTS.parent  # the repository
