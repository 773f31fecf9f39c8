"""How deep the property tests go. CI runs each machine's examples as written;
`KVPOOL_TEST_DEPTH=deep python3 dev.py test` runs ten times as many, for a local run before a
change to the allocator, the caches or the engine lands."""

import os

DEPTHS = {"ci": 1, "deep": 10}
_depth = os.environ.get("KVPOOL_TEST_DEPTH", "ci")
if _depth not in DEPTHS:
    raise ValueError(f"KVPOOL_TEST_DEPTH must be one of {sorted(DEPTHS)}, got {_depth!r}")


def examples(n: int) -> int:
    """The examples a property test runs where CI runs `n`."""
    return n * DEPTHS[_depth]
