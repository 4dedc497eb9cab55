import sys

from perseus_tf.bench.cli import main

sys.exit(main())
