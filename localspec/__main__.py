"""``python -m localspec``: see localspec.cli.main."""

import sys

from localspec.cli.main import main

sys.exit(main())
