"""``python -m calmq.cli``: how the local stack and the tests start calmq's processes."""

import sys

from calmq.cli import main

sys.exit(main())
