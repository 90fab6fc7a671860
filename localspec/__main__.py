"""``python -m localspec``: see localspec.cli."""

import sys

from localspec.cli import main

sys.exit(main())
