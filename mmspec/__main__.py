"""``python -m mmspec``: the ``mmspec`` command line (:mod:`mmspec.cli`), for environments where the console
script is not on ``PATH`` (``python -m mmspec --version``, ``python -m mmspec generate ...``)."""

import sys

from mmspec.cli import main

if __name__ == "__main__":
    sys.exit(main())
