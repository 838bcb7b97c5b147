import sys

from .command import main

sys.exit(main(prog="python -m multisoft.bench"))
