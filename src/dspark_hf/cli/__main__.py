"""`python -m dspark_hf.cli ...`: the `dspark-hf` command."""

import sys

from . import main


sys.exit(main())
