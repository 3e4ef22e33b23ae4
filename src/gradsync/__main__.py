"""`python -m gradsync` runs the gradsync command line."""

from gradsync.cli import main

raise SystemExit(main())
