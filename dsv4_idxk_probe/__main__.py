import sys

from .cli.main import run

sys.exit(run())
