"""``python -m perseus_tf.runner``: the same as the ``perseusrun`` command."""

import sys

from perseus_tf.runner.launcher import main

sys.exit(main())
