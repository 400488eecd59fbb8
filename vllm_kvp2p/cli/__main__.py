import sys

from vllm_kvp2p.cli import main

sys.exit(main())
