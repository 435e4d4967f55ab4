"""`python -m exactspec.cli`: the same as the `exactspec` command."""

import sys

from exactspec.cli import main

sys.exit(main())
