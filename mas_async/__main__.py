"""`python -m mas_async` is the `mas-async` command."""

import sys

from mas_async.cli import main

sys.exit(main())
