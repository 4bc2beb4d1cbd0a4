#!/usr/bin/env python3
"""Interactive terminal chat with any OpenAI-compatible server (the same as `nanoserve chat`).

    python clients/chat.py --url http://127.0.0.1:8000

The implementation lives in nanoserve/chat_client.py so that the installed package has it too.
"""

import sys
from pathlib import Path

try:
    from nanoserve.cli.chat import main
except ImportError:  # run from a checkout without installing nanoserve
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from nanoserve.cli.chat import main

if __name__ == "__main__":
    sys.exit(main())
