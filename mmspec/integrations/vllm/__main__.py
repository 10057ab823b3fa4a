"""``python -m mmspec.integrations.vllm``: see :mod:`mmspec.integrations.vllm.launch`."""

import sys

from .launch import main

sys.exit(main())
