"""On PYTHONPATH for every process the suite starts (tests/conftest.py): the shared compilation
cache without JAX's whole-cache scan at every write (suite_cache.py), and, while
TUNIX_TEST_TIMING is set, the process's compile times logged under the test that started it
(tests/timing/compile_log.py)."""

import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
try:
    import suite_cache

    suite_cache.patch()
    if os.environ.get("TUNIX_TEST_TIMING"):
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "timing"))
        try:
            import compile_log

            compile_log.for_subprocess()
        finally:
            sys.path.pop(0)
finally:
    sys.path.remove(HERE)
