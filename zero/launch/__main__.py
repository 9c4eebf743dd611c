"""`python -m zero.launch`: see zero/launch/__init__.py."""
import sys

from . import main

sys.exit(main())
