import sys

from gpu_watchdog.cli import main

sys.exit(main())
