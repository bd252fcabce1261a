"""`python -m hybridserve_cli ...`: the same as the `hybridserve` command."""

import sys

from hybridserve_cli import main

sys.exit(main())
