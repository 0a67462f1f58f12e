"""``python -m shardstore`` is the ``shardstore`` command."""

import sys

from shardstore.cli import main

sys.exit(main())
