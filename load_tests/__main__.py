import sys

from load_tests.run import main

sys.exit(main())
