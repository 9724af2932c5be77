"""Every pattern of the slow marker (tests/integration/conftest.py) names real tests: a pattern
that matches nothing would silently keep a slow test in the quick loop."""

from __future__ import annotations

import fnmatch
import importlib.util
import re
from pathlib import Path

INTEGRATION = Path(__file__).resolve().parent.parent / "integration"


def slow_patterns() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location(
        "integration_conftest", INTEGRATION / "conftest.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SLOW


def test_every_slow_pattern_matches_a_test():
    patterns = slow_patterns()
    assert patterns
    for pattern, why in patterns.items():
        assert why
        filename, _, test = pattern.partition("::")
        path = INTEGRATION / filename
        assert path.is_file(), pattern
        names = re.findall(r"^def (test_\w+)", path.read_text(), flags=re.MULTILINE)
        assert any(fnmatch.fnmatchcase(name, test) for name in names), pattern
