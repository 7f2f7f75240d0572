"""`python -m benchmarks.published [--rows] [--source S] [--record DATE]` (report.main)."""

from benchmarks.published.report import main

raise SystemExit(main())
