"""On PYTHONPATH only while TUNIX_TEST_TIMING is set (tests/conftest.py): a test's subprocesses
log their compile times too (compile_log.py beside this file)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
try:
    import compile_log

    compile_log.for_subprocess()
finally:
    sys.path.pop(0)
