"""``python -m kvatlas`` is the ``kvatlas`` command."""
import sys

from kvatlas.cli import main

sys.exit(main())
