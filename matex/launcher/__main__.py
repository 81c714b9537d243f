"""``python -m matex.launcher``: the same as ``matexrun``."""

import sys

from matex.launcher.cli import main

sys.exit(main())
