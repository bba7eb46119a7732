"""`python -m flowgrad ...` is the `flowgrad` command."""
import sys

from flowgrad.cli import main

sys.exit(main())
