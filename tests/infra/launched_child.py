"""A process for tests/infra/test_launcher.py: prints one JSON line of what it was started with,
then exits with the code its first argument gives, or with `wait` waits until it is killed."""

import json
import os
import signal
import sys

print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}))
sys.stdout.flush()
if sys.argv[1] == "wait":
    while True:
        signal.pause()
sys.exit(int(sys.argv[1]))
