import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import their shared blocks and helpers by name
import testpaths  # noqa: E402

testpaths.add()  # ... and each other across the package folders
