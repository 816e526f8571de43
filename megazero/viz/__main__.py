"""``python -m megazero.viz``: the schedule visualizer's command line (`megazero.viz.cli`)."""
import sys

from megazero.viz.cli import main

sys.exit(main())
