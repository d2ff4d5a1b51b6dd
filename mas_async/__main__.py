"""`python -m mas_async` is the `mas-async` command."""

import sys

from mas_async.launch.cli import main

sys.exit(main())
